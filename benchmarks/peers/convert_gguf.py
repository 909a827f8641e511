"""Convert the shared checkpoint to GGUF with llama.cpp's own convert_hf_to_gguf.py.

Runs inside the llamacpp venv (never the project's):

    PYTHONPATH=LLAMA_CPP_SRC python convert_gguf.py LLAMA_CPP_SRC CHECKPOINT OUTFILE OUTTYPE

(``LLAMA_CPP_SRC`` on the path, as when llama.cpp's converter runs as a script of its
folder: it imports its ``conversion`` package from there.)

The converter names a BPE tokenizer's pre-tokenizer by hashing how it encodes a
probe text, and refuses tokenizers it has never seen. The checkpoint's tokenizer is
built for this benchmark, so no hash can match: its pre-tokenizer is GPT-2's
byte-level regex, and that is the name given here (by replacing the lookup method, not
by editing llama.cpp's file). Prompts are sent as token ids, so no text is ever
tokenized by llama.cpp during the benchmark.
"""

from __future__ import annotations

import os
import runpy
import sys

PRE_TOKENIZER = "gpt-2"


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        sys.exit(__doc__)
    src, checkpoint, outfile, outtype = argv
    from conversion import base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    tmp = outfile + ".tmp"
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), checkpoint, "--outfile", tmp,
                "--outtype", outtype]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    os.replace(tmp, outfile)


if __name__ == "__main__":
    main(sys.argv[1:])
