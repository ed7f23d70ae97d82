"""Where a target's tokenizer comes from, and how it is written into an artifact."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specrt.errors import SpecrtError
from specrt.tokenizer_info import read_tokenizer_info

# Files copied verbatim from a Hugging Face model directory (those that exist).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt",
                      "tokenizer.model")
# Any of these means the directory ships a tokenizer.
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class TokenizerSource:
    """A tokenizer to export: a HF directory's files, or the vocabulary embedded in a GGUF."""

    kind: str  # "hf" | "gguf"
    path: Path  # the model directory (hf) or the .gguf file (gguf)
    eos_token_ids: tuple[int, ...] = ()  # model-level stop ids, merged into the manifest info

    @classmethod
    def from_hf_dir(cls, model_dir: Path, eos_token_ids: tuple[int, ...] = ()
                    ) -> "TokenizerSource | None":
        """The directory's tokenizer, or None when it has no tokenizer files."""
        if not any((model_dir / f).is_file() for f in _TOKENIZER_MARKERS):
            return None
        return cls("hf", model_dir, tuple(eos_token_ids))

    @classmethod
    def from_gguf(cls, gguf_path: Path, eos_token_ids: tuple[int, ...] = ()) -> "TokenizerSource":
        """The tokenizer embedded in a GGUF file (tokenizer.ggml.* metadata)."""
        return cls("gguf", gguf_path, tuple(eos_token_ids))

    def save(self, out_dir: Path) -> dict[str, Any]:
        """Write tokenizer.json (+ tokenizer_config.json, chat template) into `out_dir`.

        Returns manifest info: files, chat_template, bos_token_id, eos_token_ids, special_tokens.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.kind == "gguf":
            self._save_with_transformers(out_dir, self.path.parent, gguf_file=self.path.name)
        elif (self.path / "tokenizer.json").is_file():
            for name in HF_TOKENIZER_FILES:
                if (self.path / name).is_file():
                    shutil.copyfile(self.path / name, out_dir / name)
        else:  # slow-only tokenizer (sentencepiece / vocab+merges): convert to tokenizer.json
            self._save_with_transformers(out_dir, self.path)
        if not (out_dir / "tokenizer.json").is_file():
            raise SpecrtError(f"{self.path}: could not produce a tokenizer.json")
        return read_tokenizer_info(out_dir, self.eos_token_ids)

    def _save_with_transformers(self, out_dir: Path, model_dir: Path, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, **kwargs)
        except Exception as e:  # transformers raises many types for bad/unsupported vocabularies
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecrtError(f"{self.path}: cannot build tokenizer: {msg}") from None
        tok.save_pretrained(str(out_dir))
