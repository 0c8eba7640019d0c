"""llama.cpp's own converters (../shared/llama.cpp/convert), run on a tiny checkpoint made by
made_families.py, with the tiny fixtures' vocabulary.

    python convert_tiny.py VOCAB.gguf model ARGS...   # convert_hf_to_gguf.py ARGS
    python convert_tiny.py VOCAB.gguf lora ARGS...    # convert_lora_to_gguf.py ARGS

The tiny checkpoints share ../shared/fixtures/tiny's SentencePiece vocabulary, which the
converter would read through the `sentencepiece` package; its tokens are copied from VOCAB.gguf
(a fixture converted with it) instead. Everything else is the converter's own code.
"""

from __future__ import annotations

import runpy
import sys

from shared_data import SHARED

CONVERT = SHARED / "llama.cpp" / "convert"


def main() -> None:
    vocab, which, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    sys.path[:0] = [str(CONVERT), str(CONVERT / "gguf-py")]
    import gguf  # the converter's own gguf-py, as it runs
    from conversion import base

    def set_vocab(self: base.TextModel) -> None:
        fields = gguf.GGUFReader(vocab).fields

        def items(key: str) -> list:
            f = fields[key]
            return [f.parts[i] for i in f.data]

        w = self.gguf_writer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([bytes(p) for p in items("tokenizer.ggml.tokens")])
        w.add_token_scores([float(p[0]) for p in items("tokenizer.ggml.scores")])
        w.add_token_types([int(p[0]) for p in items("tokenizer.ggml.token_type")])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)

    # every family's set_vocab ends in TextModel's (through super()) but gpt-oss's, which reads
    # a GPT-2 BPE tokenizer; the LoRA converter's own set_vocab writes nothing and stays as it is
    from conversion import gpt_oss

    base.TextModel.set_vocab = set_vocab  # type: ignore[method-assign]
    gpt_oss.GptOssModel.set_vocab = set_vocab  # type: ignore[method-assign]
    script = {"model": "convert_hf_to_gguf.py", "lora": "convert_lora_to_gguf.py"}[which]
    sys.argv = [script, *args]
    runpy.run_path(str(CONVERT / script), run_name="__main__")


if __name__ == "__main__":
    main()
