"""Guard bands: every allocation of a call placed inside a larger one whose margins hold a byte pattern.

Injected through the instrumentation seam (``mqa_bwd.contract.Instruments``):
``Instruments(allocate=bands.allocate)`` makes every scratch, output and
padded-copy allocation of an implementation that supports the seam land in a
guard-banded region; ``place`` puts the inputs the harness hands over in such
regions too; ``violations`` compares every margin byte for byte.
"""

import torch

from mqa_bwd.contract import Instruments


class GuardBands:
    PATTERN = 0xA5

    def __init__(self, margin_bytes: int = 4096):
        self.margin = margin_bytes
        self.regions = []  # (label, backing uint8 tensor, start, end)

    def allocate(self, shape, dtype, device, label=None):
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(torch.Size(shape).numel())
        backing = torch.full((nbytes + 2 * self.margin,), self.PATTERN, dtype=torch.uint8, device=device)
        inner = backing[self.margin : self.margin + nbytes].view(dtype).view(shape)
        self.regions.append((label or f"allocation #{len(self.regions)} {tuple(shape)} {dtype}", backing, self.margin, self.margin + nbytes))
        return inner

    def place(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """A copy of ``t`` inside a guard-banded allocation."""
        inner = self.allocate(tuple(t.shape), t.dtype, t.device, label)
        inner.copy_(t)
        return inner

    def instruments(self) -> Instruments:
        """Instruments that allocate through these bands."""
        return Instruments(allocate=self.allocate)

    def violations(self):
        """[(label, side, first bad byte offset, bad byte count)] for every damaged margin."""
        bad = []
        for label, backing, start, end in self.regions:
            for side, band in (("before", backing[:start]), ("after", backing[end:])):
                wrong = torch.nonzero(band != self.PATTERN).reshape(-1)
                if wrong.numel():
                    bad.append((label, side, int(wrong[0]), int(wrong.numel())))
        return bad
