"""Muon and Muon+ as pure functions, plus thin optimizer shells.

Muon: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/ . Muon+: Zhang et al., "Muon+: Towards Better Muon via
One Additional Normalization Step" (arXiv 2602.21545). The update of a 2-D weight ``θ`` (r×c)
with gradient ``g``, learning rate ``η`` (parameter units per step), weight decay ``λ`` (per unit
of lr) and momentum ``μ`` is::

    B ← μ·B + (1−μ)·g                  # EMA momentum buffer, fp32
    D ← (1−μ)·g + μ·B                  # Nesterov direction (D ← B without Nesterov)
    U ← NS(D)                          # ≈ orthogonal polar factor of D, singular values ≈ 1
    U ← colnorm(rownorm(U))            # Muon+ only
    θ ← θ·(1 − η·λ) − η·sqrt(max(1, r/c))·U

so ``η`` is the step size in "spectral norm per update" units scaled for tall matrices.
``NS`` runs in the working dtype chosen by :func:`resolve_ns_dtype` (bf16 where the device
multiplies bf16 natively, as Keller Jordan's and ``torch.optim.Muon`` do; fp32 elsewhere); the
buffer ``B`` and the returned update are fp32 either way.
:class:`HybridOptimizer` couples Muon (hidden matrices) with AdamW (everything else) behind one
``torch.optim.Optimizer`` with one ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, overload

import torch
from torch import Tensor
from torch.optim import AdamW, Optimizer
from torch.optim.optimizer import ParamsT

from speedtronic.json_types import StateDict

if TYPE_CHECKING:
    from typing_extensions import Unpack

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Quintic Newton–Schulz coefficients (a, b, c) from Keller Jordan's Muon."""
NS_EPS = 1e-7
"""Epsilon added to the Frobenius norm before the iteration."""
POST_POLAR_MODES = ("none", "row", "col", "row_col", "col_row")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""Explicit Newton–Schulz working dtypes; ``"auto"`` picks one per device
(:func:`resolve_ns_dtype`)."""
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""``/proc/cpuinfo`` flags of CPUs with bf16 matrix instructions: x86 AVX-512 BF16 and AMX-BF16,
AArch64 BF16 (BFMMLA; listed under ``Features``)."""

_FUSED_FALLBACK_ERRORS = (TypeError, RuntimeError, ValueError, NotImplementedError)


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """CPU flags from the ``flags`` (x86) / ``Features`` (AArch64) lines; empty if unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


def _detect_cpu_native_bf16(cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """Uncached :func:`cpu_has_native_bf16`: torch's CPUID probes, then ``/proc/cpuinfo`` flags."""
    for probe_name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        probe = getattr(torch.cpu, probe_name, None)  # private torch API: absent in some versions
        if probe is None:
            continue
        try:
            if bool(probe()):
                return True
        except (RuntimeError, AttributeError, TypeError):
            continue
    return bool(_cpuinfo_flags(cpuinfo_path) & NATIVE_BF16_CPU_FLAGS)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (so bf16 matmul beats fp32).

    True when torch's CPUID probes report AVX-512 BF16 or AMX tiles (``torch.cpu
    ._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``), or ``/proc/cpuinfo`` lists
    ``avx512_bf16``, ``amx_bf16`` or (AArch64) ``bf16``. Without them oneDNN emulates bf16 matmul
    through fp32 and it runs several times slower than fp32. A hypervisor that hides these flags
    counts as no support. Cached for the process; ``cpu_has_native_bf16.cache_clear()`` resets it.
    """
    return _detect_cpu_native_bf16()


def resolve_ns_dtype(setting: str, device: torch.device | str) -> torch.dtype:
    """The Newton–Schulz working dtype for ``optimizer.muon_ns_dtype`` on ``device``.

    ``"bf16"`` / ``"fp32"`` are taken as given. ``"auto"`` is bf16 on a CUDA (or ROCm) device
    with bf16 tensor cores (compute capability >= 8.0) and on a CPU where
    :func:`cpu_has_native_bf16` holds; fp32 everywhere else (older GPUs, CPUs without bf16
    instructions, other device types). Raises ``ValueError`` for any other setting.
    """
    text = str(setting).strip().lower()
    if text in NS_DTYPES:
        return NS_DTYPES[text]
    if text != "auto":
        raise ValueError(f"Muon ns_dtype must be 'auto', 'bf16' or 'fp32', got {setting!r}")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.version.hip:
            return torch.bfloat16
        major, _ = torch.cuda.get_device_capability(device)
        return torch.bfloat16 if major >= 8 else torch.float32
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _working_dtype(matrix: Tensor) -> torch.dtype:
    if matrix.dtype == torch.float64:
        return torch.float64
    if matrix.is_cuda and matrix.dtype in (torch.float16, torch.bfloat16):
        try:
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16
        except (RuntimeError, AssertionError):
            pass
    return torch.float32


def _ns_iterate(x: Tensor, steps: int, eps: float) -> Tensor:
    """Quintic iteration on a wide (rows <= cols) matrix or a stack of them; ``x`` is a copy."""
    a, b, c = NS_COEFFICIENTS
    if x.ndim == 2:
        x = x / (x.norm() + eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
            x = torch.addmm(x, poly, x, beta=a)  # a·X + (bA + cA²)·X
    else:
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x


def newton_schulz(
    matrix: Tensor, steps: int = 5, eps: float = NS_EPS, dtype: torch.dtype | None = None
) -> Tensor:
    """Approximate the orthogonal polar factor ``U Vᵀ`` of ``matrix = U Σ Vᵀ``.

    Keller Jordan's quintic Newton–Schulz iteration with (a, b, c) = (3.4445, −4.7750, 2.0315):
    normalise by the Frobenius norm (+ ``eps``), then ``steps`` times ``X ← aX + (bA + cA²)X``
    with ``A = X Xᵀ``, iterating on the wide orientation. Singular values end up near 1 (roughly
    0.7–1.2 after 5 steps), not exactly 1. Dimensionless output, same shape as the input.

    Works in ``dtype`` when given; otherwise in float64 for float64 input, bfloat16 for
    half-precision CUDA input (when supported), float32 else. Returns the result in that working
    dtype. The input is never modified;
    a zero matrix maps to zeros. Raises ``ValueError`` for non-2-D input, ``steps < 1`` or
    ``eps <= 0`` and ``TypeError`` for non-floating input.
    """
    if matrix.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D matrix, got shape {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        raise TypeError(f"newton_schulz expects a floating point matrix, got {matrix.dtype}")
    if int(steps) < 1:
        raise ValueError("newton_schulz steps must be >= 1")
    if eps <= 0:
        raise ValueError("newton_schulz eps must be positive")
    work = dtype if dtype is not None else _working_dtype(matrix)
    try:
        return _orthogonalize(matrix.detach(), int(steps), float(eps), work)
    except torch.cuda.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):
        if work == torch.float32:
            raise
        return _orthogonalize(matrix.detach(), int(steps), float(eps), torch.float32)


def _orthogonalize(matrix: Tensor, steps: int, eps: float, dtype: torch.dtype) -> Tensor:
    """``newton_schulz`` without validation; also accepts a stack (..., r, c) of equal shapes."""
    x = matrix.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = _ns_iterate(x, steps, eps)
    return x.mT if tall else x


def post_polar_normalize(update: Tensor, *, mode: str = "row_col", eps: float = 1e-8) -> Tensor:
    """Muon+ normalisation of an orthogonalised update (Zhang et al., arXiv 2602.21545).

    ``row``: each row divided by ``sqrt(Σ row² + eps)``; ``col``: each column likewise;
    ``row_col``: rows then columns (every column ends at unit L2 norm); ``col_row``: columns then
    rows; ``none``: identity. Half-precision input is computed in fp32 and cast back. Returns a
    new tensor. Raises ``ValueError`` for non-2-D input, ``eps <= 0`` or an unknown mode.
    """
    if update.ndim != 2:
        raise ValueError(f"post_polar_normalize expects a 2-D matrix, got {tuple(update.shape)}")
    if eps <= 0:
        raise ValueError("post_polar_normalize eps must be positive")
    mode = str(mode).lower()
    if mode not in POST_POLAR_MODES:
        raise ValueError(f"unknown Muon+ mode {mode!r}; expected one of {POST_POLAR_MODES}")
    return _post_polar(update, mode, float(eps))


def _post_polar(update: Tensor, mode: str, eps: float) -> Tensor:
    """``post_polar_normalize`` without validation; also accepts a stack (..., r, c)."""
    x = update.float() if update.dtype in (torch.float16, torch.bfloat16) else update.clone()
    dims = {"none": (), "row": (-1,), "col": (-2,), "row_col": (-1, -2), "col_row": (-2, -1)}
    for dim in dims[mode]:  # -1: divide each row by its norm; -2: each column
        x = x * torch.rsqrt(x.square().sum(dim=dim, keepdim=True) + eps)
    return x.to(update.dtype)


def shape_scale(shape: Sequence[int]) -> float:
    """Muon's per-matrix lr factor ``sqrt(max(1, rows/cols))`` (dimensionless)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    return math.sqrt(max(1.0, rows / cols))


class DirectionOptions(TypedDict, total=False):
    """The keywords of :func:`orthogonal_direction` and :func:`muon_update` (defaults there)."""

    momentum: float
    nesterov: bool
    ns_steps: int
    eps: float
    muon_plus: bool
    norm_eps: float
    ns_dtype: torch.dtype


def muon_update(
    grad: Tensor, momentum_buffer: Tensor, **options: Unpack[DirectionOptions]
) -> Tensor:
    """Advance the fp32 ``momentum_buffer`` in place and return the scaled update direction.

    Returns ``sqrt(max(1, r/c)) · U`` in float32, where ``U`` is :func:`orthogonal_direction`
    with the same ``options``: the Newton–Schulz orthogonalisation (run in ``ns_dtype``; Muon+
    normalised if ``muon_plus``) of the Nesterov direction; the caller applies
    ``θ ← θ·(1 − ηλ) − η·result``. ``grad`` may also be a stack ``(n, r, c)`` with a matching
    buffer. ``grad`` is never modified.
    """
    update = orthogonal_direction(grad, momentum_buffer, **options)
    scale = shape_scale(update.shape)
    return update.mul_(scale) if scale != 1.0 else update


def orthogonal_direction(
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    eps: float = NS_EPS,
    muon_plus: bool = False,
    norm_eps: float = 1e-8,
    ns_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """:func:`muon_update` without the ``sqrt(max(1, r/c))`` factor (fp32, dimensionless).

    The momentum update and the Nesterov direction are fp32; only the Newton–Schulz iteration
    runs in ``ns_dtype``, and its result is returned as fp32.
    """
    g = grad.float()
    momentum_buffer.lerp_(g, 1.0 - momentum)
    direction = g.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    update = _orthogonalize(direction, int(ns_steps), float(eps), ns_dtype).float()
    if muon_plus:
        update = _post_polar(update, "row_col", float(norm_eps))
    return update


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What an optimizer's ``step(closure)`` returns: ``closure()`` run with gradients enabled
    (``step`` itself runs under ``no_grad``), or ``None`` without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


_Bucket = tuple[tuple[int, ...], torch.device]


class Muon(Optimizer):
    """Muon for 2-D parameters (see the module docstring for the update and units).

    Momentum buffers are fp32 (``state["momentum_buffer"]``) with an integer ``state["step"]``.
    ``ns_dtype`` (``auto|bf16|fp32``) is the Newton–Schulz working precision, resolved per device
    at each step by :func:`resolve_ns_dtype`; it is a speed setting of this optimizer object, not
    training state, so it is not part of ``state_dict``. Small parameters of equal shape (all of
    them on CUDA) are orthogonalised as one batch.
    ``step`` raises ``ValueError`` for a non-2-D parameter, ``RuntimeError`` for a sparse
    gradient and ``TypeError`` for a complex gradient.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        eps: float = NS_EPS,
        norm_eps: float = 1e-8,
        muon_plus: bool = False,
        ns_dtype: str = "auto",
    ) -> None:
        if lr <= 0:
            raise ValueError("Muon lr must be positive")
        resolve_ns_dtype(ns_dtype, "meta")  # validates the setting; "meta" probes no hardware
        self.ns_dtype = str(ns_dtype).strip().lower()
        if not 0.0 <= momentum < 1.0:
            raise ValueError("Muon momentum must be in [0, 1)")
        if int(ns_steps) < 1:
            raise ValueError("Muon ns_steps must be >= 1")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": int(ns_steps),
            "weight_decay": weight_decay,
            "eps": eps,
            "norm_eps": norm_eps,
            "muon_plus": muon_plus,
        }
        super().__init__(params, defaults)

    def _collect(self, group: dict[str, Any]) -> dict[_Bucket, list[tuple[Tensor, Tensor]]]:
        """Validate the group's parameters with gradients and bucket them, each with its
        gradient, by (shape, device)."""
        buckets: dict[_Bucket, list[tuple[Tensor, Tensor]]] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = param.grad
            if param.ndim != 2:
                raise ValueError(
                    f"Muon only updates 2-D parameters, got shape {tuple(param.shape)}"
                )
            if grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            if grad.is_complex():
                raise TypeError("Muon does not support complex gradients")
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] = 0
            elif state["momentum_buffer"].dtype != torch.float32:  # load_state_dict casts it
                state["momentum_buffer"] = state["momentum_buffer"].float()
            buckets.setdefault((tuple(param.shape), param.device), []).append((param, grad))
        return buckets

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply one Muon update to every parameter with a gradient; returns the closure value."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, decay = float(group["lr"]), float(group["weight_decay"])
            options = DirectionOptions(
                momentum=float(group["momentum"]),
                nesterov=bool(group.get("nesterov", True)),
                ns_steps=int(group["ns_steps"]),
                eps=float(group.get("eps", NS_EPS)),
                muon_plus=bool(group.get("muon_plus", False)),
                norm_eps=float(group.get("norm_eps", 1e-8)),
            )
            for (_, device), pairs in self._collect(group).items():
                options["ns_dtype"] = resolve_ns_dtype(self.ns_dtype, device)
                self._step_bucket(pairs, lr, decay, options)
        return loss

    def _step_bucket(
        self,
        pairs: list[tuple[Tensor, Tensor]],
        lr: float,
        decay: float,
        options: DirectionOptions,
    ) -> None:
        params = [param for param, _ in pairs]
        states = [self.state[p] for p in params]
        if len(params) == 1 or not _batch_pays_off(params[0]):
            updates = [
                orthogonal_direction(grad, s["momentum_buffer"], **options)
                for (_, grad), s in zip(pairs, states, strict=True)
            ]
        else:
            grads = torch.stack([grad.float() for _, grad in pairs])
            buffers = torch.stack([s["momentum_buffer"] for s in states])
            updates = list(orthogonal_direction(grads, buffers, **options).unbind(0))
            torch._foreach_copy_([s["momentum_buffer"] for s in states], list(buffers.unbind(0)))
        step_size = lr * shape_scale(params[0].shape)  # the shape factor folded into the lr
        for param, state, update in zip(params, states, updates, strict=True):
            state["step"] = int(state.get("step", 0)) + 1
            if decay != 0.0:
                param.mul_(1.0 - lr * decay)
            param.add_(update.to(param.dtype), alpha=-step_size)


BATCH_NUMEL_LIMIT = 16384
"""On CPU, equal-shape matrices up to this many elements are orthogonalised as one batch (the
per-call overhead dominates for small matrices; for larger ones batching measured slower)."""


def _batch_pays_off(param: Tensor) -> bool:
    return param.is_cuda or param.numel() < BATCH_NUMEL_LIMIT


def adamw_or_unfused(params: Sequence[Tensor], *, fused: bool, **hyper: Any) -> AdamW:
    """``torch.optim.AdamW(params, **hyper)``, fused when ``fused`` and the build accepts it;
    a fused build that torch refuses (device, dtype, version) falls back to the default one."""
    if fused:
        try:
            return AdamW(params, fused=True, **hyper)
        except _FUSED_FALLBACK_ERRORS:
            pass
    return AdamW(params, **hyper)


def _legacy_muon(keywords: dict[str, Any]) -> dict[str, Any]:
    """2.0.0's ``HybridOptimizer(muon_momentum=..., muon_ns_steps=..., muon_norm_eps=...,
    muon_plus=...)`` (and ``muon_ns_dtype``) as :class:`MuonSettings` fields, with a
    ``DeprecationWarning``; any other keyword is a ``TypeError`` as for any call."""
    names = {"muon_momentum", "muon_ns_steps", "muon_norm_eps", "muon_plus", "muon_ns_dtype"}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise TypeError(f"HybridOptimizer() got unexpected keyword arguments: {', '.join(unknown)}")
    warnings.warn(
        "HybridOptimizer(muon_momentum=, muon_ns_steps=, ...) is deprecated; pass "
        "muon=MuonSettings(...)",
        DeprecationWarning,
        stacklevel=3,
    )
    fields = {"muon_momentum": "momentum", "muon_ns_steps": "ns_steps", "muon_norm_eps": "norm_eps"}
    fields.update(muon_plus="muon_plus", muon_ns_dtype="ns_dtype")
    return {fields[key]: value for key, value in keywords.items()}


@dataclass(frozen=True)
class MuonSettings:
    """The Muon side of a :class:`HybridOptimizer` (``optimizer.muon_*`` in the config).

    ``momentum`` in [0, 1), ``ns_steps`` Newton–Schulz iterations, ``norm_eps`` the Muon+
    epsilon, ``muon_plus`` the post-polar normalisation, ``ns_dtype`` the Newton–Schulz working
    precision (``auto|bf16|fp32``). The defaults are 2.0.0's.
    """

    momentum: float = 0.95
    ns_steps: int = 5
    norm_eps: float = 1e-8
    muon_plus: bool = False
    ns_dtype: str = "auto"


class HybridOptimizer(Optimizer):
    """Muon for hidden matrices and AdamW for the rest, behind one optimizer facade.

    ``param_groups`` are, in order, a Muon group (``algorithm="muon"``) and an AdamW group
    (``algorithm="adamw"``), each present only when it has parameters; their hyper-parameters
    (``lr`` included, so one ``LambdaLR`` scales both) are copied into the two inner optimizers
    at every ``step``. Both inner optimizers share the facade's ``state`` dict, so ``state_dict``
    / ``load_state_dict`` / ``state.clear()`` cover both. The closure runs exactly once.
    ``muon`` (:class:`MuonSettings`, default 2.0.0's) configures the inner :class:`Muon`;
    ``betas``, ``eps`` and ``fused`` the inner AdamW; ``weight_decay`` is shared.
    """

    def __init__(
        self,
        muon_params: Iterable[Tensor],
        adamw_params: Iterable[Tensor],
        *,
        muon_lr: float,
        adamw_lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        fused: bool = False,
        muon: MuonSettings | None = None,
        **legacy: Any,
    ) -> None:
        settings = muon if muon is not None else MuonSettings()
        if legacy:  # 2.0.0's muon_momentum=, muon_ns_steps=, ... keywords, kept working
            settings = dataclasses.replace(settings, **_legacy_muon(legacy))
        resolve_ns_dtype(settings.ns_dtype, "meta")  # a bad value fails even without Muon params
        muon_list, adamw_list = list(muon_params), list(adamw_params)
        if not muon_list and not adamw_list:
            raise ValueError("HybridOptimizer needs at least one parameter")
        groups: list[dict[str, Any]] = []
        if muon_list:
            groups.append(
                {
                    "params": muon_list,
                    "algorithm": "muon",
                    "lr": float(muon_lr),
                    "momentum": float(settings.momentum),
                    "ns_steps": int(settings.ns_steps),
                    "norm_eps": float(settings.norm_eps),
                    "muon_plus": bool(settings.muon_plus),
                    "weight_decay": float(weight_decay),
                }
            )
        if adamw_list:
            groups.append(
                {
                    "params": adamw_list,
                    "algorithm": "adamw",
                    "lr": float(adamw_lr),
                    "betas": tuple(float(b) for b in betas),
                    "eps": float(eps),
                    "weight_decay": float(weight_decay),
                    "fused": bool(fused),
                }
            )
        super().__init__(groups, {"algorithm": "hybrid"})
        self.muon: Muon | None = None
        self.adamw: AdamW | None = None
        if muon_list:
            self.muon = Muon(
                muon_list,
                lr=float(muon_lr),
                momentum=float(settings.momentum),
                ns_steps=int(settings.ns_steps),
                weight_decay=float(weight_decay),
                norm_eps=float(settings.norm_eps),
                muon_plus=bool(settings.muon_plus),
                ns_dtype=settings.ns_dtype,
            )
        if adamw_list:
            self.adamw = adamw_or_unfused(
                adamw_list,
                fused=bool(fused),
                lr=float(adamw_lr),
                betas=tuple(float(b) for b in betas),
                eps=float(eps),
                weight_decay=float(weight_decay),
            )
            self.param_groups[-1]["fused"] = bool(self.adamw.param_groups[0].get("fused"))
        self._bind_children()

    def _group(self, algorithm: str) -> dict[str, Any] | None:
        return next((g for g in self.param_groups if g.get("algorithm") == algorithm), None)

    def _bind_children(self) -> None:
        """Share the facade's state dict and copy facade hyper-parameters into the children."""
        muon_group, adamw_group = self._group("muon"), self._group("adamw")
        if self.muon is not None and muon_group is not None:
            self.muon.state = self.state
            child = self.muon.param_groups[0]
            for key in ("lr", "weight_decay", "momentum", "ns_steps", "norm_eps", "muon_plus"):
                child[key] = muon_group[key]
        if self.adamw is not None and adamw_group is not None:
            self.adamw.state = self.state
            child = self.adamw.param_groups[0]
            for key in ("lr", "betas", "eps", "weight_decay"):
                child[key] = adamw_group[key]

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Evaluate ``closure`` once, then step Muon and AdamW; returns the closure value."""
        loss = closure_loss(closure)
        self._bind_children()
        if self.muon is not None:
            self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Load facade state, then re-bind both inner optimizers to it."""
        super().load_state_dict(state_dict)
        self._bind_children()
