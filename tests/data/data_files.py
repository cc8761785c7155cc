"""Small data files for the data tests, written in the test's tmp_path."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


def write_jsonl(path: Path, rows: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def verl_row(question: str, answer: str, index: int = 0) -> dict[str, Any]:
    """One row as verl's GSM8K preprocessing writes it."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index}}


def png_bytes(size: tuple[int, int], colour: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    """A solid-colour PNG of ``size`` (width, height), made with PIL."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def png_header_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels (a 20k x 20k image without its 1.2 GB)."""
    import struct
    import zlib

    data = bytearray(png_bytes((1, 1)))
    start = 8 + 8  # signature, then the IHDR chunk's length and type
    data[start:start + 8] = struct.pack(">II", width, height)
    data[start + 13:start + 17] = struct.pack(">I", zlib.crc32(bytes(data[start - 4:start + 13])))
    return bytes(data)
