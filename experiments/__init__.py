"""Variants kept only to time against the product, each self-contained (not imported by mqa_bwd).

None is kept now: the last one, the wrapper's layout steps as kernels, became the product's
(mqa_bwd.kernels.prologue); git history holds the others. A new one lives here with its
test under the ``experiments`` marker (``python -m pytest -m experiments experiments/``).
"""
