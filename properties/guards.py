"""Guard bands: every buffer of a call placed inside a larger one whose margins hold a known pattern.

Each margin is filled with a pattern chosen for what it makes visible, and
compared byte for byte after the call (``violations``), so any write to it
shows:

  write band       0xA5 bytes, around the inputs that are not float
                   (token_indices), and around the float inputs in the
                   re-runs that locate a read (below).
  read band        quiet NaN words of the buffer's dtype (bf16 0x7FE5, fp32
                   0x7FE5A5A5), around the float inputs query, kv, out,
                   grad_out, lse and attn_sink (``place_input``). A kernel
                   that reads a row before or after its buffer (index -1,
                   index S_kv) takes a NaN into its arithmetic, and the
                   outputs turn NaN. Each margin is at least one row (the
                   buffer's extent past its first two axes) long.
  denormal canary  around every allocation the call makes through the
                   instrumentation seam (``instruments``): 32-bit words
                   0x805A0035, an fp32 denormal whose 16-bit halves are bf16
                   (and fp16) denormals. A GPU fp32 atomic add
                   (red.add.f32) flushes a denormal to zero, so a stray add
                   of 0.0 at index -1 changes the word; the same add leaves
                   0xA5A5A5A5 (a normal fp32 number) as it was, and no
                   numeric comparison sees it either. ``violations`` counts
                   the words that became +-0.0 apart from other damage.

Reads of a write band or a canary go unseen (their values are finite); the
read bands see only reads whose value reaches an output. A read of a
neighbouring batch element's rows stays inside the buffer: the bands see
nothing there (the CPU model's bounds checks and compute-sanitizer do).
"""

import dataclasses

import torch

from mqa_bwd.contract import Instruments

#: The write band's byte.
WRITE_BYTE = 0xA5
#: Little-endian bytes of the denormal canary's 32-bit word 0x805A0035.
CANARY_WORD = 0x805A0035
#: Quiet NaN words of the read bands, by dtype (the payloads make them unlike any NaN a kernel writes).
NAN_WORDS = {torch.bfloat16: (0x7FE5, 2), torch.float16: (0x7E65, 2), torch.float32: (0x7FE5A5A5, 4),
             torch.float64: (0x7FFCA5A5A5A5A5A5, 8)}
#: Margins are whole multiples of this many bytes (so the inner buffer keeps the allocator's alignment).
ALIGN = 4096


def _word_bytes(word: int, size: int) -> bytes:
    return word.to_bytes(size, "little")


WRITE_PATTERN = bytes([WRITE_BYTE])
CANARY_PATTERN = _word_bytes(CANARY_WORD, 4)


def nan_pattern(dtype) -> bytes:
    """The read band's bytes for a float dtype."""
    word, size = NAN_WORDS[dtype]
    return _word_bytes(word, size)


@dataclasses.dataclass
class Region:
    """One banded buffer: ``backing`` (uint8) holds the margins and the buffer ``[start, end)``."""

    label: str
    backing: torch.Tensor
    start: int
    end: int
    pattern: bytes  # what each margin holds, repeated
    kind: str  # "write", "read" or "canary"


@dataclasses.dataclass(frozen=True)
class Violation:
    """A damaged margin: where its bytes differ from the pattern."""

    label: str
    side: str  # "before" or "after"
    kind: str  # the band's kind
    first: int  # byte offset of the first bad byte from the buffer's start (before: negative) or end (after)
    count: int  # bad bytes
    unexplained: int  # bad bytes outside the flushed canary words (all of them in other bands)
    flushed: int = 0  # canary words that are now +-0.0
    first_flushed: int | None = None  # byte offset of the first flushed word, as ``first``

    def describe(self) -> str:
        where = "from the buffer's start" if self.side == "before" else "past the buffer's end"
        text = (f"guard band ({self.kind}) {self.side} {self.label} damaged: {self.count} bytes, "
                f"the first at byte {self.first:+d} {where}")
        if self.flushed:
            text += (f"; denormal canary: {self.flushed} word(s) became +-0.0, the first at byte "
                     f"{self.first_flushed:+d}: a floating-point add flushed them (x + 0.0 flushes a denormal, as a "
                     "stray fp32 atomic add does), or zeros were written there")
        return text


def _filled(nbytes: int, pattern: bytes, device) -> torch.Tensor:
    tile = torch.tensor(list(pattern), dtype=torch.uint8, device=device)
    return tile.repeat(nbytes // len(pattern))


def _margin_for(shape, itemsize: int, minimum: int) -> int:
    """At least ``minimum`` bytes and one row (the extent past the first two axes), in whole ALIGN units."""
    row = itemsize
    for n in tuple(shape)[2:]:
        row *= int(n)
    need = max(minimum, row)
    return -(-need // ALIGN) * ALIGN


class GuardBands:
    def __init__(self, margin_bytes: int = ALIGN):
        self.margin = margin_bytes
        self.regions = []

    def _banded(self, shape, dtype, device, label, pattern, kind, margin=None) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(torch.Size(shape).numel())
        margin = self.margin if margin is None else margin
        if margin % len(pattern):
            raise ValueError(f"guard band: margin {margin} is not a whole number of {len(pattern)}-byte words")
        inner_bytes = -(-nbytes // len(pattern)) * len(pattern)  # the after band starts on a word boundary
        backing = _filled(margin + inner_bytes + margin, pattern, device)
        inner = backing[margin : margin + nbytes].view(dtype).view(shape)
        self.regions.append(Region(label, backing, margin, margin + inner_bytes, pattern, kind))
        return inner

    def allocate(self, shape, dtype, device, label=None):
        """A buffer for the implementation (the seam's ``allocate``) inside denormal canary bands;
        its own contents start as the canary pattern too."""
        label = label or f"allocation #{len(self.regions)} {tuple(shape)} {dtype}"
        return self._banded(shape, dtype, device, label, CANARY_PATTERN, "canary")

    def place(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """A copy of ``t`` inside write bands (0xA5)."""
        inner = self._banded(tuple(t.shape), t.dtype, t.device, label, WRITE_PATTERN, "write")
        inner.copy_(t)
        return inner

    def place_input(self, t: torch.Tensor, label: str, read_band: str = "both") -> torch.Tensor:
        """A copy of input ``t``: a float one inside read bands (NaN) on the sides ``read_band`` names
        ("both", "before", "after"; "none": write bands), any other inside write bands."""
        if t.dtype not in NAN_WORDS or read_band == "none":
            return self.place(t, label)
        if read_band not in ("both", "before", "after"):
            raise ValueError(f"read_band: 'both', 'before', 'after' or 'none', got {read_band!r}")
        margin = _margin_for(t.shape, t.element_size(), self.margin)
        nan = nan_pattern(t.dtype)
        inner = self._banded(tuple(t.shape), t.dtype, t.device, label, nan, "read", margin)
        region = self.regions[-1]
        if read_band != "both":  # the other side holds the write pattern (a finite value) instead
            other = slice(region.end, None) if read_band == "before" else slice(0, region.start)
            region.backing[other] = WRITE_BYTE
            region.pattern = (nan, WRITE_PATTERN) if read_band == "before" else (WRITE_PATTERN, nan)
        inner.copy_(t)
        return inner

    def instruments(self) -> Instruments:
        """Instruments that allocate through these bands."""
        return Instruments(allocate=self.allocate)

    def violations(self) -> list:
        """A ``Violation`` for every damaged margin."""
        bad = []
        for r in self.regions:
            patterns = r.pattern if isinstance(r.pattern, tuple) else (r.pattern, r.pattern)
            sides = (("before", r.backing[: r.start], patterns[0]), ("after", r.backing[r.end :], patterns[1]))
            for side, band, pattern in sides:
                wrong = band != _filled(band.numel(), pattern, band.device)
                count = int(wrong.sum())
                if not count:
                    continue
                origin = -band.numel() if side == "before" else 0
                flushed, first_flushed, unexplained = 0, None, count
                if r.kind == "canary":
                    zero_words = (band.view(torch.int32) & 0x7FFFFFFF) == 0
                    flushed = int(zero_words.sum())
                    if flushed:
                        first_flushed = origin + 4 * int(torch.nonzero(zero_words).reshape(-1)[0])
                        unexplained = int((wrong & ~zero_words.repeat_interleave(4)).sum())
                first = origin + int(torch.nonzero(wrong).reshape(-1)[0])
                bad.append(Violation(r.label, side, r.kind, first, count, unexplained, flushed, first_flushed))
        return bad
