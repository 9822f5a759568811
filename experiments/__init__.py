"""Variants kept only to time against the product, each self-contained (not imported by mqa_bwd):

  host_steps.py   the wrapper's kernel_lse and global_slots steps as TileLang kernels, through
                  the replaceable wrapper.Steps (python -m experiments.host_steps; its test:
                  python -m pytest -m experiments experiments/test_host_steps.py)
"""
