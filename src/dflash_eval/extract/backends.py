"""Explicit Gated DeltaNet kernel backend (`fla` or `torch`), and proof of which one ran.

transformers (5.15+) decorates the module-level functions `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` and `causal_conv1d_update` of each hybrid
modeling module with `use_kernel_func_from_hub_with_fallback`. At import time the decorator tries
`import fla` (resp. `causal_conv1d`) and binds the package's kernel if that works, else the torch
function, with no device check; the result is a wrapper whose `__wrapped__` is the torch function.
The two implementations give measurably different hidden states, so the choice must never depend
on what happens to be importable: `use_backend` rebinds those module globals to the named
implementation, counts every call, and `BackendRun.verify` proves after a forward that each Gated
DeltaNet layer went through exactly the selected functions.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from dflash_eval.errors import DflashEvalError
from dflash_eval.speedup.forwards.hybrid_target import GdnKernels

log = logging.getLogger(__name__)

BackendName = Literal["fla", "torch"]
BACKENDS: tuple[str, ...] = ("fla", "torch")

# Hybrid modeling modules whose Gated DeltaNet calls these module-level names.
MODELING_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
# role -> module-level name in the modeling modules
ROLE_NAMES = {
    "chunk": "torch_chunk_gated_delta_rule",
    "recurrent": "torch_recurrent_gated_delta_rule",
    "conv": "causal_conv1d_fn",
    "conv_update": "causal_conv1d_update",
}
# role -> (module, attribute) of the optimized kernel that transformers would bind
KERNELS = {
    "chunk": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "recurrent": ("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule"),
    "conv": ("causal_conv1d", "causal_conv1d_fn"),
    "conv_update": ("causal_conv1d", "causal_conv1d_update"),
}
_DISTRIBUTIONS = (
    "torch",
    "transformers",
    "flash-linear-attention",
    "fla-core",
    "triton",
    "causal-conv1d",
    "flash-qla",
    "kernels",
)


class BackendUnavailable(DflashEvalError, ValueError):
    """The requested backend cannot run on this device or in this environment."""


class BackendMismatch(DflashEvalError, RuntimeError):
    """A forward did not run (only) the selected implementation."""


@dataclass(frozen=True)
class BackendInfo:
    """What a backend binds (from `select_backend`) or what actually ran (from `verify`)."""

    name: str
    device: str
    implementation: dict[str, str]
    versions: dict[str, str]
    calls: dict[str, int] = field(default_factory=dict)
    device_name: str = ""

    def to_manifest(self) -> dict[str, Any]:
        """The `backend` block of a hidden-cache manifest."""
        return {
            "name": self.name,
            "implementation": dict(self.implementation),
            "versions": dict(self.versions),
            "calls": dict(self.calls),
            "device_name": self.device_name,
        }


def device_name(device: torch.device) -> str:
    """Human name of the accelerator ('cpu' for the CPU): kernels choose code paths by chip."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    found = []
    for dist in _DISTRIBUTIONS:
        try:
            found.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(found)


def package_versions() -> dict[str, str]:
    """Versions of every package that can change the numbers, where installed."""
    versions = dict(_installed_versions())
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
    return versions


def qualified_name(fn: Callable) -> str:
    """`module.qualname` of a function, looking through functools.wraps layers."""
    inner = inspect.unwrap(fn)
    return f"{inner.__module__}.{inner.__qualname__}"


def _loaded_modeling_modules() -> list[Any]:
    """The hybrid modeling modules that exist in this transformers (imported on demand)."""
    modules = []
    for dotted in MODELING_MODULES:
        try:
            modules.append(importlib.import_module(dotted))
        except ImportError:
            continue
    if not modules:
        raise BackendMismatch(f"none of {MODELING_MODULES} imports; this transformers has no Gated DeltaNet model")
    return modules


def torch_function(module: Any, role: str) -> Callable:
    """The pure torch implementation behind a module-level wrapper (its `__wrapped__` chain)."""
    name = ROLE_NAMES[role]
    current = getattr(module, name)
    if getattr(current, "_dflash_counted", False):
        current = current._dflash_original
    fn = inspect.unwrap(current)
    if fn.__module__ != module.__name__ or fn.__name__ != name:
        raise BackendMismatch(
            f"{module.__name__}.{name} does not unwrap to its own torch function (got {qualified_name(fn)}); "
            "this transformers binds kernels differently: update dflash_eval/extract/backends.py"
        )
    return fn


def ambient_binding(module: Any, role: str) -> str:
    """What transformers bound by itself at import (read from its wrapper's closure), for the logs."""
    original = getattr(module, ROLE_NAMES[role])
    original = getattr(original, "_dflash_original", original)
    try:
        return qualified_name(inspect.getclosurevars(original).nonlocals["implementation"])
    except (KeyError, TypeError):
        return "?"


def _fla_kernels(device: torch.device) -> dict[str, Callable]:
    """fla's Triton entry points, or a BackendUnavailable that names the fix."""
    fix = (
        "Fix: run extraction on a CUDA GPU (target.device: cuda:0) with the GPU extras installed "
        "(pip install 'dflash-eval[gpu]'); backend 'torch' runs anywhere but its states differ from fla's, "
        "and a drafter trained on fla states scores lower on them."
    )
    if device.type != "cuda":
        raise BackendUnavailable(
            f"kernel backend 'fla' cannot run on device '{device}': fla's Triton kernels need CUDA tensors. {fix}"
        )
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"kernel backend 'fla' on device '{device}': torch sees no CUDA device. {fix}")
    modules = {}
    for package in ("triton", "fla.ops.gated_delta_rule"):
        try:
            modules[package] = importlib.import_module(package)
        except Exception as error:  # a broken install fails in many ways; all mean "not usable"
            raise BackendUnavailable(
                f"kernel backend 'fla' on device '{device}': `import {package}` failed ({error}). {fix}"
            ) from error
    return {role: getattr(modules[KERNELS[role][0]], KERNELS[role][1]) for role in ("chunk", "recurrent")}


def gdn_kernels(backend: str | None, device: torch.device) -> GdnKernels:
    """The delta-rule kernels a static hybrid target (speedup/forwards/hybrid_target.py) runs, by name (`fla` or `torch`;
    None: fla on CUDA, torch elsewhere), never by what happens to import."""
    name = backend or ("fla" if device.type == "cuda" else "torch")
    _check_name(name)
    if name == "fla":
        found = _fla_kernels(device)  # raises BackendUnavailable with the fix where fla cannot run
        return GdnKernels("fla", found["chunk"], found["recurrent"])
    module = importlib.import_module(MODELING_MODULES[0])  # Qwen3.5's: the static hybrid target's architecture
    return GdnKernels("torch", torch_function(module, "chunk"), torch_function(module, "recurrent"))


@functools.cache
def _conv_kernels() -> tuple[tuple[str, Callable], ...]:
    """causal-conv1d's CUDA kernels where installed, as transformers would bind them with fla."""
    try:
        module = importlib.import_module(KERNELS["conv"][0])
        return tuple((role, getattr(module, KERNELS[role][1])) for role in ("conv", "conv_update"))
    except Exception as error:
        log.info("causal-conv1d not usable (%s): the depthwise conv runs the torch path, as in transformers", error)
        return ()


def _implementations(name: str, device: torch.device, module: Any) -> dict[str, Callable]:
    """role -> function the backend binds in `module`."""
    chosen = {role: torch_function(module, role) for role in ROLE_NAMES}
    if name == "fla":
        chosen.update(_fla_kernels(device))
        chosen.update(_conv_kernels())
    return chosen


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown kernel backend {name!r}; choose one of {list(BACKENDS)}")


def select_backend(name: BackendName, device: str | torch.device) -> BackendInfo:
    """Validate the backend for `device` and say which functions it binds; patches nothing."""
    _check_name(name)
    device = torch.device(device)
    module = _loaded_modeling_modules()[0]
    chosen = _implementations(name, device, module)
    log.info(
        "transformers bound %s by itself; backend %r forces %s",
        ambient_binding(module, "chunk"),
        name,
        qualified_name(chosen["chunk"]),
    )
    return BackendInfo(
        name=name,
        device=str(device),
        implementation={role: qualified_name(fn) for role, fn in chosen.items()},
        versions=package_versions(),
        device_name=device_name(device),
    )


def _fla_registry(fn: Callable) -> Any:
    """fla's BackendRegistry behind a dispatched entry point (found in its wrappers' closures), or None."""
    current: Any = fn
    while current is not None:
        try:
            registry = inspect.getclosurevars(current).nonlocals.get("self")
        except TypeError:
            registry = None
        if hasattr(registry, "_get_sorted_backends"):
            return registry
        current = getattr(current, "__wrapped__", None)
    return None


def _fla_dispatch(fn: Callable, args: tuple, kwargs: dict) -> str:
    """Which fla sub-backend (e.g. FlashQLA on Hopper) fla's own dispatcher picks for this call.

    fla 0.6 routes `chunk_gated_delta_rule` through `fla.backends` (FlashQLA TileLang kernels win
    on SM90 when `flash_qla` is installed); that changes the numbers too, so it is recorded.
    Reads fla internals defensively: "?" when they are not as expected.
    """
    try:
        registry = _fla_registry(fn)
        if registry is None:
            return "triton"  # not dispatched: fla's own Triton kernel
        name = inspect.unwrap(fn).__name__
        for backend in registry._get_sorted_backends():
            if backend.is_available() and backend.is_enabled():
                accepted, _ = backend.verify(name, *args, **kwargs)
                if accepted and backend.get_implementation(name) is not None:
                    return backend.backend_type
        return "triton"
    except Exception:  # introspection only; never let it break a forward
        return "?"


class BackendRun:
    """Call counters for one `use_backend` block, and the check that the selection really ran."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self.calls: Counter[str] = Counter()  # role -> calls of the selected implementation
        self.ran: dict[str, set[str]] = {}  # role -> qualified names of the functions that ran
        self.layer_calls = 0  # Gated DeltaNet module forwards seen by hooks
        self.layer_modules = 0
        self.watching = False

    def counted(self, role: str, fn: Callable, original: Callable) -> Callable:
        """`fn` behind a counter, with kwargs filtered to its signature (as transformers does)."""
        params = frozenset(inspect.signature(fn).parameters)
        is_torch = inspect.unwrap(fn) is inspect.unwrap(original)
        label = qualified_name(fn)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if is_torch and kwargs.get("cu_seqlens") is not None:
                raise BackendUnavailable(
                    "the torch Gated DeltaNet path cannot keep packed sequences apart (cu_seqlens)"
                )
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not is_torch and any(t.device.type != "cuda" for t in tensors):
                raise BackendUnavailable(
                    f"kernel backend '{self.name}': {label} got CPU tensors; move the model to a CUDA device"
                )
            kwargs = {k: v for k, v in kwargs.items() if k in params}
            self.calls[role] += 1
            sub = f"[{_fla_dispatch(fn, args, kwargs)}]" if label.startswith("fla.") else ""
            self.ran.setdefault(role, set()).add(label + sub)
            return fn(*args, **kwargs)

        call._dflash_counted = True  # type: ignore[attr-defined]
        call._dflash_original = original  # type: ignore[attr-defined]
        return call

    def watch(self, model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        """Count Gated DeltaNet module forwards: the number of rule calls that must match."""
        self.watching = True
        handles = []
        for module in model.modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                self.layer_modules += 1
                handles.append(module.register_forward_hook(self._count_layer))
        return handles

    def _count_layer(self, *_: Any) -> None:
        self.layer_calls += 1

    def verify(self) -> BackendInfo:
        """Raise unless every Gated DeltaNet forward so far ran exactly one selected rule and conv.

        Each layer forward calls one rule (chunk or recurrent) and one conv through the module
        globals. Equal counts therefore mean no layer bypassed the selection (a hub-kernelized
        forward, remote code, an unpatched module) and hence that the other implementation never ran.
        """
        if not self.watching:
            raise BackendMismatch("nothing to verify: pass the model to use_backend so its layers are watched")
        rules = self.calls["chunk"] + self.calls["recurrent"]
        convs = self.calls["conv"] + self.calls["conv_update"]
        if rules != self.layer_calls or convs != self.layer_calls:
            raise BackendMismatch(
                f"kernel backend '{self.name}' not verified: {self.layer_calls} Gated DeltaNet layer forwards "
                f"but {rules} selected delta-rule calls and {convs} selected conv calls; some layer bypassed "
                "the selection (hub kernels via use_kernels=True, trust_remote_code, or an unpatched module)"
            )
        return BackendInfo(
            name=self.name,
            device=str(self.device),
            implementation={role: " + ".join(sorted(labels)) for role, labels in sorted(self.ran.items())},
            versions=package_versions(),
            calls=dict(sorted(self.calls.items())),
            device_name=device_name(self.device),
        )


_active: BackendRun | None = None
_bound: str | None = None  # the process-wide binding of `bind_backend`, if any


def bind_backend(name: BackendName, device: str | torch.device) -> None:
    """Bind `name`'s implementations in every hybrid modeling module for the rest of the process.

    For processes whose every target forward runs one backend and that need no proof of it: the demo's
    builders and server, and the test suite's CPU references. Without it a CPU forward would go through
    whatever transformers bound at import, which is fla's Triton kernels wherever fla imports (and they
    refuse CPU tensors). A `use_backend` block inside still rebinds for its forwards and restores this
    binding after.
    """
    global _bound
    _check_name(name)
    device = torch.device(device)
    if _active is not None:
        raise BackendMismatch("bind_backend inside a use_backend block: bind before, or use the block's binding")
    for module in _loaded_modeling_modules():
        for role, fn in _implementations(name, device, module).items():
            setattr(module, ROLE_NAMES[role], _bound_call(fn, torch_function(module, role)))
    _bound = name
    log.info("kernel backend %s bound for this process on %s", name, device)


def _bound_call(fn: Callable, torch_fn: Callable) -> Callable:
    """`fn` as the module global, behind a wrapper that unwraps to the torch function as transformers' own does
    (so `torch_function` and `use_backend` still find it) and passes only the kwargs `fn` takes."""
    params = frozenset(inspect.signature(fn).parameters)

    @functools.wraps(torch_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def bound_backend() -> str | None:
    """The backend `bind_backend` bound in this process, or None (transformers' own import-time choice)."""
    return _bound


@contextmanager
def use_backend(
    name: BackendName, device: str | torch.device, model: torch.nn.Module | None = None
) -> Iterator[BackendRun]:
    """Bind `name`'s implementations in every hybrid modeling module and count calls on `model`.

    Without a model the binding still holds (e.g. for CPU reference forwards in tests, which would
    otherwise hit fla's Triton kernels wherever fla imports) but `verify` has nothing to check.
    The patch is process-global (module globals), so blocks cannot nest; everything is restored
    on exit, also on error.
    """
    global _active
    _check_name(name)
    device = torch.device(device)
    if _active is not None:
        raise BackendMismatch("use_backend blocks cannot nest: the kernel binding is process-global")
    run = BackendRun(name, device)
    saved: list[tuple[Any, str, Callable]] = []
    handles = []
    try:
        _active = run
        for module in _loaded_modeling_modules():
            chosen = _implementations(name, device, module)
            for role, fn in chosen.items():
                attr = ROLE_NAMES[role]
                original = getattr(module, attr)
                saved.append((module, attr, original))
                setattr(module, attr, run.counted(role, fn, original))
        handles = run.watch(model) if model is not None else []
        log.info("kernel backend %s on %s: %d Gated DeltaNet layers watched", name, device, run.layer_modules)
        yield run
    finally:
        for handle in handles:
            handle.remove()
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
        _active = None
