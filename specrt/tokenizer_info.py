"""What an artifact records of its tokenizer (the manifest's `tokenizer` entry), read from a saved HF tokenizer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from specrt.errors import SpecrtError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


def _token_text(tok: Any) -> str | None:
    """A special token as saved by HF: a plain string or an AddedToken dict {"content": ...}."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _load_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SpecrtError(f"{path}: cannot read JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def read_tokenizer_info(tok_dir: Path, extra_eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Manifest info (files, chat_template, bos/eos ids, special tokens) of a saved HF tokenizer."""
    import tokenizers

    tok_dir = Path(tok_dir)
    cfg = _load_json(tok_dir / "tokenizer_config.json")
    special: dict[str, str] = {}
    for source in (_load_json(tok_dir / "special_tokens_map.json"), cfg):
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(source.get(key))
            if text is not None:
                special[key] = text
    template = None
    if (tok_dir / "chat_template.jinja").is_file():
        template = (tok_dir / "chat_template.jinja").read_text(encoding="utf-8")
    elif isinstance(cfg.get("chat_template"), str):
        template = cfg["chat_template"]
    elif isinstance(cfg.get("chat_template"), list):  # named templates: prefer "default"
        named = {t.get("name"): t.get("template") for t in cfg["chat_template"]}
        template = named.get("default") or next(iter(named.values()), None)
    tok = tokenizers.Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    bos = tok.token_to_id(special["bos_token"]) if "bos_token" in special else None
    eos = [tok.token_to_id(special["eos_token"])] if "eos_token" in special else []
    eos_ids = list(dict.fromkeys(int(i) for i in [*eos, *extra_eos_token_ids] if i is not None))
    files = sorted(p.name for p in tok_dir.iterdir() if p.is_file())
    return {"files": files, "chat_template": template, "bos_token_id": bos,
            "eos_token_ids": eos_ids, "special_tokens": special}
