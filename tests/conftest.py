"""Shared test setup: tiny models run single-threaded.

The test models are far too small to gain from intra-op threads, and OpenMP worker threads that
spin on a busy 2-core machine can stall a forward for minutes.
"""

import os

import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
