"""Turn a model's loss into the graphs a worker runs, exported with `jax.export`.

The worker never sees Python model code: it gets serialized StableHLO for

- ``init_opt_state(params) -> opt_state``
- ``train_chunk(params, opt_state, batches[K, ...], first_step) -> (params, opt_state, losses[K])``
  (K inner optimizer steps in one ``lax.scan``; ``first_step`` is the run's
  global inner step of the first of them, which sets the learning rate)
- ``eval_loss(params, batches[N, ...]) -> mean loss``
- ``score_loss(params, rows[1, R, ...]) -> mean loss`` (the shepherd's own: R rows of a
  result's batches, which validation scores; see `pcp_tui.diloco.validation`)

For a worker with N devices (`devices` > 1) the same graphs are exported over
an N-device mesh: each device runs the loss and its gradient on its B/N rows
inside `jax.shard_map` (so custom calls such as cuDNN attention see the
per-device batch, which XLA's partitioner cannot give them), and the
gradient reduction is written out: an all-reduce mean over the devices for
a replicated parameter; for an `fsdp` one, an all-gather before use and a
reduce-scatter of its gradient. The optimizer step runs on the parameters as
they are placed (see `pcp_tui.training.sharding`).

Parameters and optimizer state cross the graph boundary as flat tuples of arrays
(parameters in ``param_names`` order), so no custom pytree has to be serialized
and a worker only ever handles lists of tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import export
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from pcp_tui.training.sharding import Axis, LayoutError, param_axes, state_axes

Batch = TypeVar("Batch")  # one inner step's batch: a jax.Array, or a tuple of them
LossFn = Callable[[dict[str, jax.Array], Batch], jax.Array]

# The one axis of a multi-device export's mesh; a worker's mesh names its axis the same.
MESH_AXIS = "data"


@dataclass(frozen=True)
class InnerOptimizer:
    """The optimizer each worker runs for its H inner steps."""

    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine decay to lr/10 over this many steps; 0 keeps lr constant
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95

    def schedule(self) -> optax.Schedule:
        """Learning rate as a function of the run's global inner step (not a worker's own count)."""
        if self.decay_steps > self.warmup_steps:
            return optax.warmup_cosine_decay_schedule(
                0.0, self.lr, max(self.warmup_steps, 1), self.decay_steps, self.lr / 10
            )
        if self.warmup_steps > 0:
            return optax.linear_schedule(0.0, self.lr, self.warmup_steps)
        return optax.constant_schedule(self.lr)

    def direction(self) -> optax.GradientTransformation:
        """The update before the learning rate: clipping, Adam's moments, decoupled weight decay.

        The step taken is ``-schedule(global_step) * direction``, which is exactly
        optax.adamw / optax.sgd with that schedule. The schedule is applied
        outside the optimizer state on purpose: a worker that joins late,
        reconnects or restarts starts fresh moments (Adam's bias correction
        counts its own steps) but follows the run's warm-up and decay.
        """
        if self.name == "adamw":
            # Decay matrices only, as GPT-2/nanoGPT do: not biases or layer-norm scales.
            decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
            step = optax.chain(
                optax.scale_by_adam(b1=self.b1, b2=self.b2),
                optax.add_decayed_weights(self.weight_decay, decay_mask),
            )
        elif self.name == "sgd":
            step = optax.identity()
        else:
            raise ValueError(f"unknown inner optimizer {self.name!r} (adamw | sgd)")
        if self.grad_clip > 0:
            return optax.chain(clip_by_global_norm(self.grad_clip), step)
        return step


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm written as a product: updates * min(1, max_norm / norm).

    The same numbers when no clipping happens (the factor is exactly 1), within one
    rounding when it does. optax picks between the clipped and unclipped updates
    with a select on one boolean; IREE reads such a scalar predicate back to the
    host, which ends the step's command buffer and waits for the GPU in the middle
    of every inner step (a `hal.fence.await` per step in the compiled program).
    A float factor stays on the device.
    """

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        norm = optax.tree.norm(updates)
        factor = jnp.minimum(1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclass(frozen=True)
class TrainingGraphs:
    """Serialized graphs plus what both sides need to call them."""

    param_names: tuple[str, ...]
    train_chunk: bytes
    init_opt_state: bytes
    eval_loss: bytes
    platforms: tuple[str, ...]
    chunk_steps: int
    score_loss: bytes = b""  # exported only where `score_rows` asked for it (the shepherd's)

    def as_dict(self) -> dict[str, bytes]:
        return {
            "train_chunk": self.train_chunk,
            "init_opt_state": self.init_opt_state,
            "eval_loss": self.eval_loss,
        }


def build_graphs(
    loss_fn: LossFn[Batch],
    params: Mapping[str, Any],
    batch_spec: Any,
    *,
    inner: InnerOptimizer,
    chunk_steps: int,
    eval_batches: int,
    platforms: tuple[str, ...] = ("cpu", "cuda", "rocm"),
    custom_calls: tuple[str, ...] = (),
    scan_unroll: int = 1,
    devices: int = 1,
    sharding: Any = None,
    exchange_dtype: str = "float32",
    score_rows: int = 0,
) -> TrainingGraphs:
    """Export the worker's graphs for `platforms`.

    `batch_spec` is the shape of one inner step's batch (for a language model,
    int32[B, T+1]; for a row dataset a tuple of [B, ...] specs); `train_chunk`
    takes `chunk_steps` of them stacked on a new leading axis.
    `custom_calls` names custom-call targets (e.g. cuDNN fused attention) that
    jax.export would otherwise refuse because their ABI is not guaranteed
    stable: such graphs run only on workers whose jaxlib has the same kernels.
    `scan_unroll` inner steps are unrolled into straight-line code per loop trip
    (`lax.scan`'s `unroll`; `chunk_steps` leaves no loop). XLA gains nothing from it;
    IREE then records the chunk's GPU commands once and replays them (memoized, no
    copies of the loop's carried state between steps), for a compile of more code.
    `devices` > 1 exports `train_chunk` and `init_opt_state` for a worker with that many
    devices, parameters placed as `sharding` (a plan's `Sharding`) says; LayoutError
    if the batch does not split over them; its devices gather parameters and reduce
    gradients in `exchange_dtype` (see `_Mesh.gradient`). `eval_loss` is always for one
    device. `score_rows` R > 0 also exports `score_loss`, the eval graph over one batch of R
    rows (validation's cost is R rows a pass, whatever the run's batch size).
    """
    names = tuple(sorted(params))
    param_specs = tuple(jax.ShapeDtypeStruct(np.shape(params[n]), jnp.float32) for n in names)
    optimizer, schedule = inner.direction(), inner.schedule()
    opt_specs = jax.eval_shape(optimizer.init, dict(zip(names, param_specs, strict=True)))
    opt_leaves_spec, opt_tree = jax.tree.flatten(opt_specs)

    def as_dict(flat: tuple) -> dict[str, jax.Array]:
        return dict(zip(names, flat, strict=True))

    def init_opt_state(flat_params: tuple) -> tuple:
        return tuple(jax.tree.leaves(optimizer.init(as_dict(flat_params))))

    shapes = tuple(s.shape for s in param_specs)
    mesh = _Mesh(devices, param_axes(names, shapes, sharding, devices) if devices > 1 else ())
    gradient = (
        mesh.gradient(loss_fn, names, shapes, batch_spec, jnp.dtype(exchange_dtype))
        if devices > 1
        else jax.value_and_grad(loss_fn)
    )

    def train_chunk(flat_params: tuple, opt_leaves: tuple, batches: jax.Array, first_step):
        def one_step(carry, inputs):
            p, s = carry
            batch, step = inputs
            value, grads = gradient(p, batch)
            direction, s = optimizer.update(grads, s, p)
            lr = schedule(step)
            p = jax.tree.map(lambda w, d: w - (lr * d).astype(w.dtype), p, direction)
            return (p, s), value

        carry = (as_dict(flat_params), jax.tree.unflatten(opt_tree, opt_leaves))
        steps = first_step + jnp.arange(chunk_steps, dtype=jnp.int32)
        (p, s), losses = jax.lax.scan(one_step, carry, (batches, steps), unroll=scan_unroll)
        return tuple(p[n] for n in names), tuple(jax.tree.leaves(s)), losses

    def eval_loss(flat_params: tuple, batches: jax.Array) -> jax.Array:
        p = as_dict(flat_params)
        return jnp.mean(jax.lax.map(lambda b: loss_fn(p, b), batches))

    def stacked(n: int, rows: int | None = None) -> Any:
        """`n` batches of `batch_spec`, each of `rows` rows if given."""
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((n, rows or s.shape[0], *s.shape[1:]), s.dtype),
            batch_spec,
        )

    allowed = [export.DisabledSafetyCheck.custom_call(target) for target in custom_calls]

    def exported(fn, *specs, placed=None) -> bytes:
        jitted = jax.jit(fn) if placed is None else jax.jit(fn, **placed)
        return bytes(
            export.export(jitted, platforms=platforms, disabled_checks=allowed)(*specs).serialize()
        )

    opt_leaf_specs = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in opt_leaves_spec)
    batches = stacked(chunk_steps)
    chunk_at = init_at = None  # one device: exported unplaced, as always
    if devices > 1:
        mesh.check_batch(batches)
        params_at = mesh.placed(mesh.param_axes, shapes)
        opt_shapes = tuple(s.shape for s in opt_leaf_specs)
        opt_at = mesh.placed(state_axes(opt_shapes, shapes, mesh.param_axes), opt_shapes)
        batches_at = jax.tree.map(lambda s: mesh.sharding(1, s.ndim), batches)
        chunk_at = {
            "in_shardings": (params_at, opt_at, batches_at, mesh.sharding(None, 0)),
            "out_shardings": (params_at, opt_at, mesh.sharding(None, 1)),
        }
        # keep_unused: the parameters' values are unused (only their shapes), and an input the
        # module drops has no placement in the artifact, which the worker's mesh must know
        init_at = {"in_shardings": (params_at,), "out_shardings": opt_at, "keep_unused": True}
    return TrainingGraphs(
        param_names=names,
        train_chunk=exported(
            train_chunk,
            param_specs,
            opt_leaf_specs,
            batches,
            jax.ShapeDtypeStruct((), jnp.int32),
            placed=chunk_at,
        ),
        init_opt_state=exported(init_opt_state, param_specs, placed=init_at),
        eval_loss=exported(eval_loss, param_specs, stacked(eval_batches)),
        platforms=platforms,
        chunk_steps=chunk_steps,
        score_loss=(
            exported(eval_loss, param_specs, stacked(1, score_rows)) if score_rows > 0 else b""
        ),
    )


class _Mesh:
    """A one-axis mesh of `devices` devices to export for: this process's, or abstract."""

    def __init__(self, devices: int, axes: tuple[Axis, ...]):
        self.devices, self.param_axes = devices, axes
        # Auto: the partitioner places what the shardings leave open (newer JAX defaults to
        # Explicit, where shard_map would demand every argument's sharding in its type).
        # An abstract mesh needs no devices here, but JAX lowers cuDNN attention only over
        # real ones (any platform's: the artifact keeps the placements, not the devices).
        self.mesh: jax.sharding.Mesh | AbstractMesh | None = None
        if devices > 1:
            local = jax.devices()
            self.mesh = (
                jax.sharding.Mesh(np.array(local[:devices]), (MESH_AXIS,), (AxisType.Auto,))
                if len(local) >= devices
                else AbstractMesh((devices,), (MESH_AXIS,), axis_types=(AxisType.Auto,))
            )

    def spec(self, axis: Axis, ndim: int) -> PartitionSpec:
        """Split on `axis` over the devices (None: a copy on each)."""
        return PartitionSpec(*(MESH_AXIS if i == axis else None for i in range(ndim)))

    def sharding(self, axis: Axis, ndim: int) -> NamedSharding:
        assert self.mesh is not None, "one device: nothing to place"
        return NamedSharding(self.mesh, self.spec(axis, ndim))

    def placed(self, axes: Any, shapes: Any) -> tuple[NamedSharding, ...]:
        return tuple(self.sharding(a, len(s)) for a, s in zip(axes, shapes, strict=True))

    def check_batch(self, batches: Any) -> None:
        """LayoutError unless every batch leaf's B (axis 1 of [K, B, ...]) splits over the devices."""
        for leaf in jax.tree.leaves(batches):
            if leaf.shape[1] % self.devices:
                raise LayoutError(
                    f"this run's batch size {leaf.shape[1]} does not split over a worker's "
                    f"{self.devices} devices: restart that worker with --devices set to a "
                    f"divisor of {leaf.shape[1]} (--devices 1 always works), or the shepherd "
                    f"with --batch-size a multiple of {self.devices}"
                )

    def gradient(
        self, loss_fn: LossFn, names: tuple[str, ...], shapes: tuple, batch: Any, dtype: Any
    ):
        """`jax.value_and_grad(loss_fn)` of the global batch, computed per device and reduced.

        Each device gathers its `fsdp` parameters whole and differentiates the
        mean loss of its B/N rows, with the parameters cast to vary by device so
        that the gradient is its own (nothing summed implicitly); then the
        reduction: the mean over the devices of the loss and of each gradient,
        as an all-reduce (replicated) or a reduce-scatter (`fsdp`). The mean of
        N equal parts' means is the global batch's mean, for a loss that is a
        mean over its rows (a loss weighted per row would need its weights summed).

        Parameters are gathered, and gradients reduced, in `dtype` (the mixed
        precision of PyTorch FSDP's `param_dtype` and `reduce_dtype`): for a loss that
        casts every parameter to `dtype` as it starts (GPT-2 at `--compute-dtype
        bfloat16`) no forward value changes, and each device's gradient is already a
        `dtype` value upcast; only the N-term sums round to `dtype`. Half the bytes
        of float32 cross between the devices.
        """
        axes = dict(zip(names, self.param_axes, strict=True))

        def per_device(params: dict, rows: Any) -> tuple[jax.Array, dict]:
            whole = {
                name: jax.lax.pcast(p.astype(dtype), MESH_AXIS, to="varying")
                if axes[name] is None
                else jax.lax.all_gather(p.astype(dtype), MESH_AXIS, axis=axes[name], tiled=True)
                for name, p in params.items()
            }
            value, grads = jax.value_and_grad(loss_fn)(whole, rows)
            reduced = {
                name: (
                    jax.lax.pmean(g, MESH_AXIS)
                    if axes[name] is None
                    else jax.lax.psum_scatter(
                        g, MESH_AXIS, scatter_dimension=axes[name], tiled=True
                    )
                    / self.devices
                ).astype(jnp.float32)
                for name, g in grads.items()
            }
            return jax.lax.pmean(value, MESH_AXIS), reduced

        params = {n: self.spec(axes[n], len(s)) for n, s in zip(names, shapes, strict=True)}
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(params, jax.tree.map(lambda s: self.spec(0, s.ndim), batch)),
            out_specs=(PartitionSpec(), params),
        )
