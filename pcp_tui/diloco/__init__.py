"""The DiLoCo algorithm on the shepherd: screening pseudo-gradients, averaging them, the outer step."""
