"""The implementation under test: any function with the docs/SPEC.md signature.

    fn(query, kv, out, grad_out, lse, attn_sink, token_indices, sm_scale,
       *, block_h=None, dkv_buf_bytes=None, backend=None) -> (dq, dkv, d_attn_sink)

A ``Target`` names it as ``module:function`` (imported from the Python path
exactly as given, so a user's wrapper of ours works), with the backend it is
asked for and the device its tensors live on. Properties drive it only
through that signature, plus the optional seam ``mqa_bwd.contract``
describes, which an implementation may leave out:

  instruments=            a keyword taking an ``Instruments``: the harness
                          injects a guard-banded allocator and counts
                          launches and allocations
  fn.default_backend()    the backend it picks when none is given
  fn.backend_unavailable(backend)
                          why that backend cannot run here, or None
  fn.domain               what it supports: a ``mqa_bwd.contract.Domain``
                          (or a callable returning one, for a wrapper that
                          forwards to another function); without it, the
                          whole SPEC domain. The command line may override
                          it field by field (``--mqa-domain``).
  fn.tested_spec()        for such a wrapper: the 'module:function' it runs
                          (what the known-failure ledger and the outside-
                          domain probe name)
"""

import dataclasses
import importlib
import inspect
from typing import Callable

from mqa_bwd.contract import GPU_BACKENDS, OURS, OUTPUT_NAMES, SPEC_ARGS, Domain, backend_device  # noqa: F401 (re-exported)


def load_function(spec: str, option: str = "--impl") -> Callable:
    """'package.module:function' (or 'module:Class.method') -> the callable.

    Errors are ValueErrors naming ``option``, the flag or variable the spec came from.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{option}: expected module:function, got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{option}: cannot import module {module_name!r}: {err}") from err
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{option}: {module_name!r} has no attribute {attribute!r}") from None
    if not callable(obj):
        raise ValueError(f"{option}: {spec!r} is not callable")
    return obj


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def takes_instruments(function: Callable) -> bool:
    """Does ``function`` offer the instrumentation seam (an ``instruments=`` keyword)? A wrapper that
    forwards its keywords says so itself with a ``takes_instruments()`` attribute."""
    declared = getattr(function, "takes_instruments", None)
    if callable(declared):
        return bool(declared())
    try:
        return "instruments" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False


def declared_domain(function: Callable, option: str = "--impl") -> Domain:
    """What ``function`` says it supports: its ``domain`` attribute (a Domain, or a callable returning
    one); the whole SPEC domain without one."""
    declared = getattr(function, "domain", None)
    if declared is None:
        return Domain()
    if not isinstance(declared, Domain) and callable(declared):
        declared = declared()
    if not isinstance(declared, Domain):
        raise ValueError(f"{option}: the function's domain attribute is a {type(declared).__name__}, "
                         "not a mqa_bwd.contract.Domain")
    return declared


@dataclasses.dataclass(frozen=True)
class Target:
    function: Callable
    spec: str = OURS  # "module:function", as given on the command line
    backend: str | None = None
    device: str = "cpu"
    #: What the implementation supports: its declared domain, overridden by the command line.
    domain: Domain = Domain()
    #: Where the domain came from: "spec" (nothing declared), "declared", "command line".
    domain_source: str = "spec"

    @classmethod
    def load(cls, spec: str | None = None, backend: str | None = None, domain: str | None = None) -> "Target":
        """``domain``: the command line's text (``Domain.parse``): the fields it names replace the
        declared ones ('spec': the whole SPEC domain)."""
        spec = spec or OURS
        function = load_function(spec)
        if backend is None and callable(getattr(function, "default_backend", None)):
            backend = function.default_backend()
        declared = declared_domain(function)
        chosen, source = declared, ("spec" if declared.is_spec else "declared")
        if domain is not None:
            chosen = Domain.parse(domain, base=declared, option="--mqa-domain")
            source = "spec" if chosen.is_spec else ("declared" if chosen == declared else "command line")
        return cls(function, spec, backend, backend_device(backend, _cuda_available), chosen, source)

    @property
    def name(self) -> str:
        """The 'module:function' under test: ``spec``, or what a forwarding wrapper says it runs."""
        tested = getattr(self.function, "tested_spec", None)
        return str(tested()) if callable(tested) else self.spec

    @property
    def instrumented(self) -> bool:
        """Does the implementation take ``instruments=`` (so launch counts and injected
        allocations speak for it)?"""
        return takes_instruments(self.function)

    @property
    def needs_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def unavailable(self) -> str | None:
        """Why this target cannot run on this machine, or None."""
        if self.needs_gpu and not _cuda_available():
            return f"backend {self.backend!r} needs a CUDA GPU; this machine has none"
        ask = getattr(self.function, "backend_unavailable", None)
        return ask(self.backend) if callable(ask) else None

    def __call__(self, tensors: dict, **options):
        """Call with framework tensors (SPEC_ARGS keys) and keyword options."""
        if self.backend is not None:
            options.setdefault("backend", self.backend)
        return self.function(*[tensors[name] for name in SPEC_ARGS], **options)

    def with_function(self, function: Callable, spec: str) -> "Target":
        return dataclasses.replace(self, function=function, spec=spec)
