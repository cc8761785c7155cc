"""Images in prompt records, for vision-language policies (docs/vision.md).

Formats read: verl's (an ``images`` column of ``{"bytes", "path"}`` dicts or paths, ``<image>`` placeholders in
the chat prompt's text) and TRL's (an ``image`` or ``images`` column, chat content parts ``{"type": "image"}``;
prompts without a placeholder get the images at the start of their first user turn, as TRL puts them), each image
as bytes, a local file (a relative path is read from the data file's folder) or a PIL image. A record keeps its
images as :class:`ImageRef` s (undecoded, with the row and column they came from) under ``images``, its prompt as
chat messages whose content is a list of parts; :func:`open_image` decodes one with PIL and names the row and the
column of a bad one (corrupt, missing, zero size, or over PIL's decompression-bomb bound).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hybridflow.data.records import CHAT_ROLES, IMAGES, Record
from hybridflow.fields import FieldError

IMAGE_COLUMNS = ("images", "image")  # verl's column and TRL's (``image``: one image a row)
PLACEHOLDER = "<image>"  # verl's marker of an image in a prompt's text
IMAGE_PART: dict[str, str] = {"type": "image"}
Part = dict[str, str]


@dataclass(frozen=True, kw_only=True)
class VisionData:
    """How prompt images are read: resized by the model's processor to between ``min_pixels`` and ``max_pixels``
    pixels (None: the processor's own bounds), and ``bad_images``: ``error`` stops at the first bad image (naming
    its row and column), ``skip`` drops its row and counts it."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    bad_images: Literal["error", "skip"] = "error"

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise FieldError(name, value, "must be a positive number of pixels (or unset: the processor's)")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise FieldError("min_pixels", self.min_pixels, f"is above max_pixels={self.max_pixels}",
                             related=("max_pixels",))
        if self.bad_images not in ("error", "skip"):
            raise FieldError("bad_images", self.bad_images, "must be 'error' or 'skip'")


class BadImageError(ValueError):
    """An image that cannot be used; the message names the row, the column, the image's index and the fix."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a row, undecoded: ``source`` (bytes, a file path, or a PIL image) and where it came from."""

    source: Any
    where: str  # the row: "data.jsonl line 3"
    column: str
    index: int  # its place in the row's list of images

    @property
    def named(self) -> str:
        return f"{self.where}, column {self.column!r} image {self.index}"


def image_column(row: Mapping[str, Any]) -> str | None:
    """The row's image column (``images``, else ``image``), None for a text-only row."""
    return next((name for name in IMAGE_COLUMNS if row.get(name) is not None), None)


def image_refs(row: Mapping[str, Any], column: str, *, where: str, base: Path | None = None) -> list[ImageRef]:
    """The images of ``row[column]``: one image or a list, each bytes, a path (relative ones under ``base``), a
    ``{"bytes", "path"}`` dict (HF datasets' Image storage) or a PIL image."""
    value = row[column]
    items = list(value) if isinstance(value, list | tuple) else [value]
    refs = []
    for index, item in enumerate(items):
        if isinstance(item, Mapping):
            item = item.get("bytes") or item.get("path")
            if item is None:
                raise BadImageError(f"{where}, column {column!r} image {index}: a dict with neither 'bytes' nor "
                                    "'path'; give the image's bytes or its file")
        if isinstance(item, str) and base is not None and not Path(item).is_absolute():
            item = str(base / item)
        if not isinstance(item, bytes | str) and not hasattr(item, "convert"):
            raise BadImageError(f"{where}, column {column!r} image {index}: a {type(item).__name__}, not an image; "
                                "give bytes, a file path or a {'bytes', 'path'} dict")
        refs.append(ImageRef(item, where, column, index))
    return refs


def vision_messages(prompt: object, images: int, *, where: str) -> list[dict[str, Any]]:
    """``prompt`` as chat messages whose content is a list of parts, one ``{"type": "image"}`` per image.

    verl's ``<image>`` markers in a message's text become image parts where they stand; TRL's image parts stay;
    a prompt without either gets its images at the start of its first user turn. A plain-text prompt is one user
    turn. The number of placeholders must equal the row's images."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise ValueError(f"{where}: the prompt is {prompt!r}; give a string or a list of chat messages")
    roles = [_role(m, i, where) for i, m in enumerate(messages)]
    contents = [_parts(m.get("content"), i, where) for i, m in enumerate(messages)]
    placeholders = sum(part == IMAGE_PART for parts in contents for part in parts)
    if placeholders == 0 and images:
        first = roles.index("user") if "user" in roles else 0
        contents[first] = [dict(IMAGE_PART) for _ in range(images)] + contents[first]
    elif placeholders != images:
        raise ValueError(f"{where}: the prompt has {placeholders} image placeholders ({PLACEHOLDER!r} or "
                         f"{{'type': 'image'}} parts) but the row has {images} images; give one placeholder per image "
                         "(or none: the images then open the first user turn)")
    return [{"role": role, "content": parts} for role, parts in zip(roles, contents, strict=True)]


def _role(message: Mapping[str, Any], index: int, where: str) -> str:
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"{where}: prompt message {index} has role {role!r}; chat roles are {list(CHAT_ROLES)}")
    return str(role)


def _parts(content: object, index: int, where: str) -> list[Part]:
    if isinstance(content, str):
        pieces = content.split(PLACEHOLDER)
        parts: list[Part] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append(dict(IMAGE_PART))
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                parts.append(dict(IMAGE_PART))
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ValueError(f"{where}: prompt message {index} has content part {part!r}; parts are "
                                 '{"type": "text", "text": str} or {"type": "image"}')
        return parts
    raise ValueError(f"{where}: prompt message {index} has content {content!r}; give text or a list of parts")


def open_image(ref: ImageRef) -> Any:
    """``ref`` decoded as an RGB PIL image; a bad image raises :class:`BadImageError` naming its row and column."""
    from PIL import Image

    source = ref.source
    if hasattr(source, "convert"):  # a PIL image already
        image = source
    else:
        try:
            if isinstance(source, bytes) and not source:
                raise BadImageError(f"{ref.named}: empty bytes, not an image")
            if isinstance(source, str) and not Path(source).is_file():
                raise BadImageError(f"{ref.named}: no image file {source}")
            with warnings.catch_warnings():
                # Over MAX_IMAGE_PIXELS PIL warns, over twice that it raises: both are refused (a 20k x 20k image
                # would take 1.2 GB decoded, and the processor resizes it to max_pixels anyway).
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
                image.load()
        except BadImageError:
            raise
        except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
            raise BadImageError(f"{ref.named}: too large to decode ({err}); downscale it") from err
        except (OSError, SyntaxError, ValueError) as err:  # PIL's decoders raise these on corrupt data
            raise BadImageError(f"{ref.named}: not a readable image ({err})") from err
    width, height = image.size
    if width == 0 or height == 0:
        raise BadImageError(f"{ref.named}: zero size ({width} x {height})")
    return image.convert("RGB")


@dataclass(frozen=True, kw_only=True)
class CheckedImages:
    """Records whose images all decode, each one's image sizes ((width, height) per image), and how many rows were
    skipped for a bad image (``bad_images=skip``)."""

    records: list[Record]
    sizes: list[list[tuple[int, int]]]
    skipped: int
    first_error: str | None = None


def check_images(records: Sequence[Record], *, bad_images: str = "error") -> CheckedImages:
    """Decode every image of ``records`` once, so that a bad one stops the run before training, naming its row and
    column (``bad_images="error"``), or drops its row, counted (``"skip"``)."""
    kept: list[Record] = []
    sizes: list[list[tuple[int, int]]] = []
    first: str | None = None
    for record in records:
        try:
            sizes.append([open_image(ref).size for ref in record.get(IMAGES, ())])
        except BadImageError as err:
            if bad_images != "skip":
                raise BadImageError(f"{err}. Fix or drop the row, or skip such rows (bad_images=skip)") from err
            first = first or str(err)
            continue
        kept.append(record)
    return CheckedImages(records=kept, sizes=sizes, skipped=len(records) - len(kept), first_error=first)


def has_images(records: Sequence[Record]) -> bool:
    return any(record.get(IMAGES) for record in records)
