"""A stand-in for flash-linear-attention as a `.[gpu]` install presents it to a CPU forward.

On a GPU machine fla imports, so transformers (5.24: `use_kernel_func_from_hub_with_fallback`) binds its Triton
kernels into the Gated DeltaNet modeling modules at import, and those kernels refuse the CPU tensors of the demo's
builders, its server and the tests' references. Put this folder on PYTHONPATH (tests/packaging/test_fla_importable.py) and any CPU forward
that did not bind its backend fails the same way, on a machine without triton.
"""

__version__ = "0.0+cpu-refusing-stand-in"
