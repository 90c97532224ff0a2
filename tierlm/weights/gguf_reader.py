"""Opening a GGUF file and reading its key/value metadata, with damage reported as TierlmError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

from tierlm.errors import TierlmError


class GgufMetadata:
    """Typed access to a GGUFReader's key/value metadata; `arch` is general.architecture."""

    def __init__(self, reader, path: Path):
        self.reader = reader
        self.path = path
        self.arch = self.get("general.architecture")
        if not isinstance(self.arch, str):
            raise TierlmError(f"{path} has no general.architecture; it is not a model GGUF")

    def get(self, key: str, default: Any = None) -> Any:
        """The value stored under `key` (e.g. "tokenizer.ggml.tokens"), or `default` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as err:  # a damaged field surfaces here, inside gguf's own parser
            raise _corrupt(self.path, err) from None

    def arch_get(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: `arch_get("block_count")` reads "llama.block_count"."""
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        """Like `arch_get`, but a missing key is a TierlmError naming it."""
        value = self.arch_get(key)
        if value is None:
            raise TierlmError(f"{self.path} lacks the metadata key {self.arch}.{key}", hint="the GGUF is incomplete")
        return value


class _CheckedReader(GGUFReader):
    """GGUFReader that names the tensor whose type id is unknown or whose rows are no whole
    blocks of its type, before gguf builds the tensors (whose own errors name none)."""

    def __init__(self, path: Path):
        self.source = path
        super().__init__(path)

    def _build_tensors(self, start_offs, fields):
        for field in fields:
            _check_tensor_info(self.source, field)
        return super()._build_tensors(start_offs, fields)


def _check_tensor_info(path: Path, field) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:  # gguf's tensor info layout: name length, name, dim count, dims (fastest first), type, offset
        name = bytes(field.parts[1]).decode("utf-8", errors="replace")
        dims, type_id = [int(d) for d in field.parts[3]], int(field.parts[4][0])
    except (IndexError, TypeError, ValueError):
        return  # another layout: gguf's own checks apply
    where = f"{path}: tensor {name}"
    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        raise TierlmError(f"{where} has the unknown GGUF type id {type_id}",
                          hint="the file is corrupt or newer than this gguf package reads") from None  # fmt: skip
    block = GGML_QUANT_SIZES.get(kind, (1, 0))[0]
    if dims and dims[0] % block:
        raise TierlmError(f"{where} has rows of {dims[0]} values, not whole {kind.name} blocks of {block}",
                          hint="the file is corrupt; download or convert it again")  # fmt: skip


def open_gguf(gguf_path: Path):
    """A GGUFReader over the file, with gguf's and numpy's errors turned into TierlmError."""
    if not gguf_path.is_file():
        raise TierlmError(f"GGUF file not found: {gguf_path}", hint="check the path")
    try:
        return _CheckedReader(gguf_path)
    except TierlmError:
        raise
    except Exception as err:  # gguf raises ValueError/IndexError/struct errors for damaged files
        raise _corrupt(gguf_path, err) from None


def _corrupt(path: Path, err: BaseException) -> TierlmError:
    return TierlmError(
        f"{path} is not a readable GGUF file ({type(err).__name__}: {err})",
        hint="it may be truncated or corrupt; download or convert it again",
    )
