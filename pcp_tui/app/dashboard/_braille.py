"""A braille canvas: 2x4 dots per terminal cell, for line charts without a plotting library."""

from __future__ import annotations

# Bit of each dot in a braille character, indexed [x][y] inside the 2x4 cell.
_DOT_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


class BrailleCanvas:
    """Dots on a grid of `width` x `height` cells; each cell remembers the last series drawn in it.

    Pixel (0, 0) is the top left; x grows right, y grows down. Points outside the
    canvas are dropped, so callers may draw lines that leave the plot area.
    """

    def __init__(self, width: int, height: int):
        self.width, self.height = max(width, 0), max(height, 0)
        self._dots = [[0] * self.width for _ in range(self.height)]
        self._series = [[-1] * self.width for _ in range(self.height)]
        self._marks: dict[tuple[int, int], str] = {}

    @property
    def pixel_width(self) -> int:
        return self.width * 2

    @property
    def pixel_height(self) -> int:
        return self.height * 4

    def point(self, x: int, y: int, series: int) -> None:
        if 0 <= x < self.pixel_width and 0 <= y < self.pixel_height:
            row, col = y // 4, x // 2
            self._dots[row][col] |= _DOT_BITS[x % 2][y % 4]
            self._series[row][col] = max(self._series[row][col], series)

    def mark(self, x: int, y: int, char: str, series: int) -> None:
        """Put `char` in the cell holding pixel (x, y), over any dots: a point that must stand out."""
        if 0 <= x < self.pixel_width and 0 <= y < self.pixel_height:
            row, col = y // 4, x // 2
            self._marks[row, col] = char
            self._series[row][col] = max(self._series[row][col], series)

    def line(self, x0: int, y0: int, x1: int, y1: int, series: int) -> None:
        """Bresenham's line from (x0, y0) to (x1, y1), both ends included."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            self.point(x0, y0, series)
            if x0 == x1 and y0 == y1:
                return
            double = 2 * error
            if double >= dy:
                error += dy
                x0 += sx
            if double <= dx:
                error += dx
                y0 += sy

    def rows(self) -> list[list[tuple[str, int]]]:
        """Each cell as (character, series index or -1 when empty)."""
        return [
            [
                (self._marks.get((row, col)) or (chr(0x2800 + bits) if bits else " "), series)
                for col, (bits, series) in enumerate(zip(dots, owners, strict=True))
            ]
            for row, (dots, owners) in enumerate(zip(self._dots, self._series, strict=True))
        ]
