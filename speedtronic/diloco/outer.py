"""Master side of DumbDiLoCo: the Nesterov outer optimizer and the aggregation loop.

One round of :class:`MasterOuterLoop` is::

    reconcile (once) -> discover deltas -> validate/skip -> average (fp32, equal weight)
        -> Nesterov step -> publish weights + processed set + version, prune (one commit)
        -> persist locally (atomic) -> hand the new global to the training thread

Local state lives in ``<state_dir>/outer_state.safetensors`` (global weights + momentum) and
``<state_dir>/outer_state.json`` (outer step, processed identities). The processed set is also
published as ``global/processed.json``, so a master with a lost or corrupt disk rebuilds from
the Hub without aggregating any delta twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from speedtronic.checkpoint import atomic_json_dump, atomic_write_bytes
from speedtronic.diloco import tensors as T
from speedtronic.diloco.transport import RemoteNotFound, TransportError

__all__ = ["MasterOuterLoop", "NesterovOuterOptimizer", "nesterov_update"]

_LOG = logging.getLogger("speedtronic.diloco")
Identity = tuple[str, int, int]


def nesterov_update(
    weight: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float, momentum: float
) -> None:
    """One SGD-Nesterov step with the pseudo-gradient as gradient (DiLoCo, Douillard et al. 2023).

    In place: ``buf = momentum*buf + g``; ``weight -= lr*(g + momentum*buf)``. Computed in
    float32, applied in the weight's dtype. From zero momentum the first step is
    ``weight - lr*(1+momentum)*g`` (1.9·g at μ=0.9).
    """
    g32 = grad.to(device=weight.device, dtype=torch.float32)
    if g32.is_complex():
        g32 = g32.real
    buf.mul_(momentum).add_(g32)
    effective = buf.mul(momentum).add_(g32)  # g + momentum * buf, one temporary
    if weight.dtype == torch.float32:
        weight.add_(effective, alpha=-lr)
    else:
        weight.sub_((lr * effective).to(weight.dtype))


class NesterovOuterOptimizer:
    """Float32 CPU momentum buffers for every floating key of ``state``; ``step`` is in place."""

    def __init__(self, state: Mapping[str, torch.Tensor], lr: float, momentum: float = 0.9):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_buffers: dict[str, torch.Tensor] = {
            k: torch.zeros(tuple(v.shape), dtype=torch.float32)
            for k, v in state.items()
            if v.is_floating_point() or v.is_complex()
        }

    @torch.no_grad()
    def step(self, state: dict[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient ``delta`` to ``state`` in place."""
        for key, grad in delta.items():
            if key not in state:
                raise KeyError(key)
            weight = state[key]
            if tuple(weight.shape) != tuple(grad.shape):
                raise ValueError(f"shape mismatch for {key}")
            if not (weight.is_floating_point() or weight.is_complex()):
                continue
            buf = self.momentum_buffers.setdefault(
                key, torch.zeros(tuple(weight.shape), dtype=torch.float32)
            )
            nesterov_update(weight, grad, buf, lr=self.lr, momentum=self.momentum)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU clones of the momentum buffers."""
        return {k: v.detach().clone() for k, v in self.momentum_buffers.items()}

    def load_state_dict(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Replace every buffer with a float32 CPU clone."""
        self.momentum_buffers = {
            str(k): v.detach().to("cpu", torch.float32).clone() for k, v in buffers.items()
        }


class MasterOuterLoop:
    """Aggregates worker deltas into the published global model (one daemon thread)."""

    def __init__(
        self,
        transport: Any,
        state: Mapping[str, torch.Tensor],
        *,
        node_state_dir: str | os.PathLike,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        poll_interval: float = 60.0,
        on_global_update: Callable[[dict[str, torch.Tensor], int], None] | None = None,
        emit: Callable[[str, dict[str, Any]], None] | None = None,
        log: Any = None,
    ):
        self.hub = transport
        self.global_state = T.cpu_state_dict(state)
        self.state_dir = Path(node_state_dir)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.poll_interval = float(poll_interval)
        self.outer_step = 0
        self.processed_deltas: set[Identity] = set()
        self.optimizer = NesterovOuterOptimizer(self.global_state, outer_lr, outer_momentum)
        self.on_global_update = on_global_update
        self._emit = emit or (lambda event, payload: _LOG.info("%s %s", event, payload))
        self._log = log or _LOG
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()
        self.has_local_state = False
        self.local_state_corrupt = False
        self.reconciled = False
        self._load_local_state()

    # -- local persistence ---------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        """Tensors: ``global/<key>`` and ``momentum/<key>``."""
        return self.state_dir / "outer_state.safetensors"

    @property
    def metadata_path(self) -> Path:
        """JSON: outer step, processed identities, sha256 of the tensor file."""
        return self.state_dir / "outer_state.json"

    def _load_local_state(self) -> None:
        if not self.metadata_path.exists() and not self.state_path.exists():
            return
        try:
            meta = json.loads(self.metadata_path.read_text(encoding="utf-8"))
            data = self.state_path.read_bytes()
            if meta.get("sha256") and hashlib.sha256(data).hexdigest() != meta["sha256"]:
                raise ValueError("checksum mismatch")
            tensors, _ = T.state_from_bytes(data)
            glob = {k[7:]: v for k, v in tensors.items() if k.startswith("global/")}
            for key, value in self.global_state.items():
                if key not in glob or tuple(glob[key].shape) != tuple(value.shape):
                    raise ValueError(f"global tensor {key} missing or reshaped")
            step = int(meta["outer_step"])
            processed = {(str(n), int(s), int(b)) for n, s, b in meta.get("processed", [])}
        except Exception as exc:
            self.local_state_corrupt = True
            stamp = int(time.time())
            for path in (self.state_path, self.metadata_path):
                if path.exists():
                    path.replace(path.with_name(f"{path.name}.corrupt-{stamp}"))
            self._log.error(
                f"corrupt local outer state in {self.state_dir} ({type(exc).__name__}: {exc}); "
                "moved aside, rebuilding from the published global state"
            )
            return
        self.global_state = {k: glob[k].to(v.dtype) for k, v in self.global_state.items()}
        self.optimizer = NesterovOuterOptimizer(
            self.global_state, self.outer_lr, self.outer_momentum
        )
        self.optimizer.load_state_dict(
            {k[9:]: v for k, v in tensors.items() if k.startswith("momentum/")}
        )
        self.outer_step = step
        self.processed_deltas = processed
        self.has_local_state = True

    def _save_local_state(self) -> None:
        tensors = {f"global/{k}": v for k, v in self.global_state.items()}
        tensors.update({f"momentum/{k}": v for k, v in self.optimizer.state_dict().items()})
        data = T.state_to_bytes(tensors)
        meta = {
            "outer_step": self.outer_step,
            "processed": sorted([list(i) for i in self.processed_deltas]),
            "sha256": hashlib.sha256(data).hexdigest(),
            "updated_at": datetime.now(timezone.utc).isoformat(),
        }
        atomic_write_bytes(data, self.state_path)
        atomic_json_dump(meta, self.metadata_path)
        self.has_local_state = True

    # -- reconcile with the published state ------------------------------------------------------
    def reconcile(self) -> bool:
        """Agree with the repository once: bootstrap, adopt a newer remote, or re-publish.

        Returns False (try again next round) when the repository cannot be read; a read
        failure never leads to a bootstrap that could overwrite a live global.
        """
        remote = self.hub.global_metadata()
        if remote is None:
            with self._lock:
                step, state = self.outer_step, T.cpu_state_dict(self.global_state)
                processed = set(self.processed_deltas)
            extra = {"algorithm": "dumb_diloco", "bootstrap": str(step == 0).lower()}
            self.hub.publish_global(
                state, outer_step=step, processed=processed, metadata_extra=extra
            )
            self._log.info(f"published global state at outer step {step} (bootstrap)")
        else:
            remote_processed = set(self.hub.read_processed())
            with self._lock:
                self.processed_deltas |= remote_processed
                local_ok = self.has_local_state and not self.local_state_corrupt
            if remote.outer_step > self.outer_step or not local_ok:
                state = self.hub.read_global(remote)
                self.adopt_global_state(state, remote.outer_step, reset_momentum=True)
                self._log.info(f"adopted published global at outer step {remote.outer_step}")
            elif remote.outer_step < self.outer_step:
                with self._lock:
                    step, state = self.outer_step, T.cpu_state_dict(self.global_state)
                    processed = set(self.processed_deltas)
                extra = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}
                self.hub.publish_global(
                    state, outer_step=step, processed=processed, metadata_extra=extra
                )
        with self._lock:
            self.reconciled = True
            self.local_state_corrupt = False
            try:
                self._save_local_state()
            except OSError as exc:
                self._log.warning(f"could not persist local outer state: {exc}")
            step, state = self.outer_step, T.cpu_state_dict(self.global_state)
        if self.on_global_update is not None:
            self.on_global_update(state, step)
        return True

    def adopt_global_state(
        self, state: Mapping[str, torch.Tensor], outer_step: int, *, reset_momentum: bool = False
    ) -> None:
        """Replace the global (matching keys and shapes) and the outer step."""
        with self._lock:
            for key, value in state.items():
                if key in self.global_state and tuple(value.shape) == tuple(
                    self.global_state[key].shape
                ):
                    self.global_state[key] = T.cpu_tensor(value).to(self.global_state[key].dtype)
            self.outer_step = int(outer_step)
            if reset_momentum:
                self.optimizer = NesterovOuterOptimizer(
                    self.global_state, self.outer_lr, self.outer_momentum
                )

    # -- one round ------------------------------------------------------------------------------
    def sync_once(self) -> int:
        """Run one aggregation round; returns the outer step afterwards."""
        started = time.perf_counter()
        if not self.reconciled and not self.reconcile():
            return self.outer_step
        with self._lock:
            processed = set(self.processed_deltas)
            reference = {k: v for k, v in self.global_state.items()}
        paths = self.hub.delta_paths()
        valid: list[tuple[Identity, str, dict[str, torch.Tensor]]] = []
        consumed: list[str] = []
        skipped = corrupt = 0
        for path in paths:
            node, step = T.parse_delta_path(path)  # delta_paths only returns parseable paths
            try:
                delta, header = self.hub.read_delta(path)
                base = int(header.get("base_outer_step", "-1"))
                T.validate_delta(delta, reference)
            except RemoteNotFound:
                continue
            except TransportError as exc:
                skipped += 1
                self._log.warning(f"could not download delta {path}; retrying next round: {exc}")
                continue
            except Exception as exc:
                corrupt += 1
                if path not in self._warned:
                    self._warned.add(path)
                    self._log.warning(f"skipping corrupt delta {path}: {type(exc).__name__}: {exc}")
                continue
            identity = (node, step, base)
            if identity in processed or any(identity == v[0] for v in valid):
                skipped += 1
                consumed.append(path)
                continue
            valid.append((identity, path, delta))
        if not valid:
            if consumed:
                try:
                    self.hub.prune(consumed)
                except TransportError as exc:
                    self._log.warning(f"could not prune consumed deltas: {exc}")
            self._event(len(paths), [], skipped, corrupt, started)
            return self.outer_step
        average = T.average_deltas([d for _, _, d in valid])
        with self._lock:
            old = (
                self.outer_step,
                set(self.processed_deltas),
                T.cpu_state_dict(self.global_state),
                self.optimizer.state_dict(),
            )
            self.optimizer.step(self.global_state, average)
            self.outer_step += 1
            self.processed_deltas |= {i for i, _, _ in valid}
            step, candidate = self.outer_step, T.cpu_state_dict(self.global_state)
            ledger = set(self.processed_deltas)
        try:
            self.hub.publish_global(
                candidate,
                outer_step=step,
                processed=ledger,
                prune=[p for _, p, _ in valid] + consumed,
                metadata_extra={"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"},
            )
        except Exception:
            with self._lock:
                self.outer_step, self.processed_deltas, self.global_state, momentum = old
                self.optimizer.load_state_dict(momentum)
            raise
        with self._lock:
            try:
                self._save_local_state()
            except OSError as exc:
                self._log.warning(
                    f"published global but could not persist local outer state: {exc}"
                )
        if self.on_global_update is not None:
            self.on_global_update(candidate, step)
        self._event(len(paths), [i for i, _, _ in valid], skipped, corrupt, started)
        return step

    def _event(
        self, found: int, included: list[Identity], skipped: int, corrupt: int, started: float
    ) -> None:
        self._emit(
            "outer_step",
            {
                "outer_step": self.outer_step,
                "deltas_found": found,
                "deltas_included": len(included),
                "deltas_skipped": skipped,
                "deltas_corrupt": corrupt,
                "seconds": time.perf_counter() - started,
                "included": [f"{n}/{s}/{b}" for n, s, b in included],
            },
        )

    # -- thread -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the daemon thread ``speedtronic-diloco-master`` (first round immediately)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="speedtronic-diloco-master", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception as exc:
                self._log.warning(f"DumbDiLoCo outer round failed: {type(exc).__name__}: {exc}")
            self._stop.wait(self.poll_interval)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread (no final round); joins for up to ``timeout`` seconds."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout if timeout is not None else max(1.0, min(self.poll_interval, 10.0)))
        self._thread = None

    # -- state ------------------------------------------------------------------------------------
    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(outer_step, clone of the global state)``."""
        with self._lock:
            return self.outer_step, T.cpu_state_dict(self.global_state)

    def state_dict(self) -> dict[str, Any]:
        """Outer step, processed identities and momentum (the global lives in outer_state files)."""
        with self._lock:
            return {
                "outer_step": self.outer_step,
                "processed_deltas": sorted([list(i) for i in self.processed_deltas]),
                "momentum": self.optimizer.state_dict(),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Merge a checkpointed outer state: processed sets are united; the newer step wins."""
        with self._lock:
            self.processed_deltas |= {
                (str(n), int(s), int(b)) for n, s, b in state.get("processed_deltas", [])
            }
            step = int(state.get("outer_step", 0))
            if step > self.outer_step and "global_state" in state:
                self.adopt_global_state(state["global_state"], step)
                self.optimizer.load_state_dict(state.get("momentum", {}))
