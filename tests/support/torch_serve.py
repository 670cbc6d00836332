"""`transformers serve` with the torch Gated DeltaNet path bound: `python tests/support/torch_serve.py serve ...`.

The tests serve their tiny hybrid target on the CPU. Where fla imports (a GPU machine with `.[gpu]`), transformers
binds fla's Triton kernels into the modeling modules, and they refuse CPU tensors: every request then answers
HTTP 500. This runs transformers' own CLI in a process whose binding is chosen explicitly first, as the demo
server's is (dflash_eval.demo.server).
"""

import sys

from dflash_eval.extract.backends import bind_backend


def main(argv: list[str]) -> None:
    bind_backend("torch", "cpu")
    from transformers.cli.transformers import main as transformers_cli

    sys.argv = ["transformers", *argv]
    transformers_cli()


if __name__ == "__main__":
    main(sys.argv[1:])
