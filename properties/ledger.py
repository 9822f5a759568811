"""The known-failure ledger: which properties are known to fail for an implementation, and why.

A TOML (Python 3.11+) or JSON file of entries, given as ``--mqa-known-failures
FILE`` (``mqa-bwd check --known-failures FILE``)::

    [[known_failure]]
    impl = "mqa_bwd.cudnn:cudnn_backward"   # required: as --impl names it
    property = "determinism"                # required: a property of the suite
    reason = "dkv and d_attn_sink are summed with fp32 atomics"   # required: why
    backend = "..."                         # optional: only when run with this backend
    findings = ["dkv", "d_attn_sink"]       # optional: the only sub-checks that may fail
                                            #   (the outputs, for agreement and determinism)
    domain = "heads=64-128"                 # optional: only cases inside this domain (Domain text)
    case = { sink = ["random", "large"] }   # optional: only cases with these field values
    strict = false                          # optional (default true): see below

(JSON: ``{"known_failure": [{...}, ...]}``.) An entry covers a failing case
when its impl, backend, property, domain and case filter all match, and every
sub-check that failed is one of its ``findings``. In a run:

- A failure an entry covers is expected: the property is reported as xfail,
  with the entry's reason and the first such case. An entry without a domain
  or case filter ends the property there (its failure is known); with one,
  the search goes on, and a failure the entry does not cover is a failure.
- An entry whose property held on every case it covers (at least one) is an
  unexpected pass, and fails the property (strict): the ledger is out of
  date, or the implementation has changed. ``strict = false`` makes it a note
  instead, for a failure that shows only on some runs (fp32 atomics whose
  order happens to change no bit on a small case).
- An entry that covered no case drawn says so, and decides nothing.
"""

import dataclasses
import json
from pathlib import Path

from mqa_bwd.contract import Domain

from .case import Case
from .checks import PROPERTY_NAMES
from .strategies import dimensions

#: How the suite's report of a failure the ledger covers begins (its xfail reason); the tools read it
#: back from pytest's output (mqa_bwd.fuzz, mqa_bwd.cli).
KNOWN_FAILURE = "known failure"
ENTRY_FIELDS = ("impl", "property", "reason", "backend", "findings", "domain", "case", "strict")
_CASE_FIELDS = {f.name for f in dataclasses.fields(Case)}


@dataclasses.dataclass(frozen=True)
class KnownFailure:
    impl: str
    property: str
    reason: str
    backend: str | None = None
    findings: tuple | None = None
    domain: Domain | None = None
    case: tuple | None = None  # ((field, (values...)), ...)
    source: str = ""  # "FILE, entry N"
    strict: bool = True  # an unexpected pass fails the run (False: it is a note)

    @property
    def filtered(self) -> bool:
        """Does the entry cover only some cases?"""
        return self.domain is not None or self.case is not None

    def applies_to(self, impl: str, backend: str | None, prop: str) -> bool:
        return self.impl == impl and self.property == prop and self.backend in (None, backend)

    def covers_case(self, case: Case) -> bool:
        if self.domain is not None and not self.domain.contains(**dimensions(case)):
            return False
        return all(getattr(case, name) in values for name, values in (self.case or ()))

    def covers_failure(self, findings: dict) -> bool:
        """Is every sub-check that failed one this entry expects to fail?"""
        if self.findings is None:
            return True
        failed = {name for name, held in findings.items() if held is False}
        return bool(failed) and failed <= set(self.findings)

    def describe(self) -> str:
        scope = []
        if self.backend:
            scope.append(f"backend {self.backend}")
        if self.findings:
            scope.append(f"in {', '.join(self.findings)}")
        if self.domain is not None:
            scope.append(f"for cases in {self.domain}")
        if self.case:
            scope.append("for " + ", ".join(f"{k} in {list(v)}" for k, v in self.case))
        return f"{self.property}" + (f" ({'; '.join(scope)})" if scope else "") + f": {self.reason}"


def _entry(raw, where: str, option: str) -> KnownFailure:
    if not isinstance(raw, dict):
        raise ValueError(f"{option}: {where}: expected a table of fields, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(ENTRY_FIELDS))
    if unknown:
        raise ValueError(f"{option}: {where}: unknown field(s) {', '.join(unknown)}; fields: {', '.join(ENTRY_FIELDS)}")
    for name in ("impl", "property", "reason"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise ValueError(f"{option}: {where}: {name} is required (a non-empty text)"
                             + ("; a known failure must say why it is known" if name == "reason" else ""))
    if raw["property"] not in PROPERTY_NAMES:
        raise ValueError(f"{option}: {where}: property {raw['property']!r} is not one of {', '.join(PROPERTY_NAMES)}")
    findings = raw.get("findings")
    if findings is not None:
        if isinstance(findings, str) or not all(isinstance(f, str) for f in findings) or not findings:
            raise ValueError(f"{option}: {where}: findings is a list of sub-check names, e.g. [\"dkv\"]")
        findings = tuple(findings)
    domain = raw.get("domain")
    if domain is not None:
        domain = Domain.parse(str(domain), option=f"{option}: {where}: domain")
    case = raw.get("case")
    if case is not None:
        if not isinstance(case, dict) or not case:
            raise ValueError(f"{option}: {where}: case is a table of Case fields, e.g. {{ sink = \"none\" }}")
        bad = sorted(set(case) - _CASE_FIELDS)
        if bad:
            raise ValueError(f"{option}: {where}: case: {', '.join(bad)} not Case fields ({', '.join(sorted(_CASE_FIELDS))})")
        case = tuple(sorted((k, tuple(v) if isinstance(v, list) else (v,)) for k, v in case.items()))
    backend = raw.get("backend")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"{option}: {where}: backend is a text")
    strict = raw.get("strict", True)
    if not isinstance(strict, bool):
        raise ValueError(f"{option}: {where}: strict is true or false, got {strict!r}")
    return KnownFailure(raw["impl"].strip(), raw["property"], raw["reason"].strip(), backend, findings, domain, case,
                        where, strict)


def load(path, option: str = "--mqa-known-failures") -> tuple:
    """The entries of a ledger file (ValueErrors naming ``option``, the entry and the field)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"{option}: cannot read {str(path)!r} ({err.strerror or err})") from None
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{option}: TOML needs Python 3.11 or later; write the ledger as JSON") from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{option}: {path} is not TOML: {err}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{option}: {path} is not JSON (name a TOML ledger *.toml): {err}") from None
    entries = data.get("known_failure") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"{option}: {path}: expected a list of [[known_failure]] entries")
    if isinstance(data, dict) and set(data) - {"known_failure"}:
        raise ValueError(f"{option}: {path}: unknown top-level key(s) {sorted(set(data) - {'known_failure'})}")
    return tuple(_entry(raw, f"{path.name}, entry {i + 1}", option) for i, raw in enumerate(entries))


@dataclasses.dataclass
class Tally:
    """What one property test saw of the entries that apply to it."""

    entries: tuple
    expected: int = 0  # failing cases an entry covered
    held: int = 0  # cases an entry covers on which the property held
    first: tuple | None = None  # (entry, case, the verdict's first line)

    def expect(self, entry: KnownFailure, case: Case, headline: str) -> None:
        self.expected += 1
        if self.first is None:
            self.first = (entry, case, headline)

    def seen(self) -> str:
        """What the run saw of the covered failure: how often, and its first case's verdict line."""
        return f"seen in {self.expected} case(s); first: {self.first[2]}"

    def xfail_reason(self) -> str:
        entry, case, _ = self.first
        return f"{KNOWN_FAILURE} ({entry.source}): {entry.reason} | {self.seen()}; case {case.to_json()}"

    def known_failure(self) -> dict:
        """The xfail reason's pieces, for the run's summary: readers take them as they are, since a
        reason may hold any text (the xfail reason's separators included)."""
        entry, case, _ = self.first
        return {"source": entry.source, "reason": entry.reason, "seen": self.seen(), "case": case.to_dict()}

    @property
    def strict(self) -> bool:
        """Whether an unexpected pass fails the run: unless every entry says strict = false."""
        return any(e.strict for e in self.entries)

    def xpass_message(self) -> str:
        entries = "; ".join(f"{e.source}: {e.describe()}" for e in self.entries)
        return (f"[XPASS(strict)] the ledger says this property fails ({entries}), but it held on all "
                f"{self.held} case(s) the entry covers: remove or narrow the entry")
