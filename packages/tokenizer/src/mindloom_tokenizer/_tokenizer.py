"""`Tokenizer`: one small API over a SentencePiece model or a character-level vocabulary.

A tokenizer is a directory (see docs/contracts.md):

    tokenizer.model          SentencePiece model (bpe / unigram), the source of truth
    char_vocab.json          the vocabulary of a `char` model (instead of tokenizer.model)
    mindloom_tokenizer.json  metadata: model type, vocab size, special ids, how it was trained

The `char` model is native rather than SentencePiece because SentencePiece cannot round-trip
raw text exactly (it never sees newlines, it maps spaces to U+2581) and always reserves an
unknown id, so it cannot reproduce nanoGPT's 65-symbol Shakespeare vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np

MODEL_FILE = "tokenizer.model"
CHAR_VOCAB_FILE = "char_vocab.json"
META_FILE = "mindloom_tokenizer.json"
HF_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
FORMAT_VERSION = 1
UNK_SURFACE = " \u2047 "  # what SentencePiece prints for an unknown piece
_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(ValueError):
    """A tokenizer cannot be trained, loaded or used; the message is one line."""


def default_num_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class _CharModel:
    """Character-level vocabulary: one id per Unicode code point, specials as their own ids."""

    KINDS = ("char", "unk", "control")

    def __init__(self, pieces: list[str], kinds: list[str], source: str = "<memory>"):
        if len(pieces) != len(kinds):
            raise TokenizerError(f"{source}: 'pieces' and 'kinds' differ in length")
        self.pieces = pieces
        self.kinds = kinds
        self.unk_id = -1
        self._char_to_id: dict[str, int] = {}
        for i, (p, k) in enumerate(zip(pieces, kinds)):
            if k not in self.KINDS:
                raise TokenizerError(f"{source}: piece {i} has unknown kind {k!r}")
            if k == "char":
                if not isinstance(p, str) or len(p) != 1:
                    raise TokenizerError(f"{source}: char piece {i} is not one character: {p!r}")
                if p in self._char_to_id:
                    raise TokenizerError(f"{source}: character {p!r} appears twice")
                self._char_to_id[p] = i
            elif k == "unk":
                self.unk_id = i
        # A code-point -> id table makes encoding a numpy gather instead of a Python loop.
        top = max((ord(c) for c in self._char_to_id), default=0)
        self._table = np.full(top + 1, -1, dtype=np.int64)
        for c, i in self._char_to_id.items():
            self._table[ord(c)] = i
        self._surface = [
            p if k == "char" else (UNK_SURFACE if k == "unk" else "") for p, k in zip(pieces, kinds)
        ]

    @classmethod
    def from_file(cls, path: str, expected_sha256: str | None = None) -> _CharModel:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise TokenizerError(f"cannot read {path}: {exc.strerror or exc}") from None
        if expected_sha256 and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise TokenizerError(
                f"{path} does not match model_sha256 in {META_FILE} (files from different runs?)"
            )
        try:
            obj = json.loads(data.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("pieces"), list):
            raise TokenizerError(f"{path}: expected an object with a 'pieces' list")
        pieces = obj["pieces"]
        kinds = obj.get("kinds", ["char"] * len(pieces))
        if not isinstance(kinds, list):
            raise TokenizerError(f"{path}: 'kinds' must be a list")
        return cls(pieces, kinds, source=path)

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "pieces": self.pieces, "kinds": self.kinds}

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = np.full(cps.shape, -1, dtype=np.int64)
        inside = cps < len(self._table)
        ids[inside] = self._table[cps[inside]]
        missing = ids < 0
        if missing.any():
            if self.unk_id < 0:
                first = chr(int(cps[np.argmax(missing)]))
                raise TokenizerError(
                    f"character {first!r} (U+{ord(first):04X}) is not in the char vocabulary "
                    "and the model has no unknown id"
                )
            ids[missing] = self.unk_id
        return ids.tolist()

    def decode(self, ids: Iterable[int]) -> str:
        surface = self._surface
        n = len(surface)
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise TokenizerError(f"id {i} is out of range for vocab size {n}")
            out.append(surface[i])
        return "".join(out)


class Tokenizer:
    """A trained tokenizer. Create it with `Tokenizer.load` or `train_tokenizer`."""

    def __init__(self, backend, metadata: dict, path: str | None = None):
        self._backend = backend
        self.metadata = dict(metadata)
        self.path = path
        if isinstance(backend, _CharModel):
            self.model_type = "char"
            self.vocab_size = len(backend)
            kinds = backend.kinds
            ids = {k: self.metadata.get(k, -1) for k in ("bos_id", "eos_id", "pad_id", "unk_id")}
            ids["unk_id"] = backend.unk_id
            for k in ("bos_id", "eos_id", "pad_id"):
                i = ids[k]
                if not isinstance(i, int) or not (i == -1 or (0 <= i < len(kinds))):
                    raise TokenizerError(f"{META_FILE}: {k}={i!r} is out of range")
                if i >= 0 and kinds[i] != "control":
                    raise TokenizerError(f"{META_FILE}: {k}={i} is not a special token")
        else:
            self.model_type = str(self.metadata.get("model_type") or _spm_model_type(backend))
            self.vocab_size = int(backend.get_piece_size())
            ids = {
                "bos_id": backend.bos_id(),
                "eos_id": backend.eos_id(),
                "pad_id": backend.pad_id(),
                "unk_id": backend.unk_id(),
            }
        self.bos_id: int = ids["bos_id"]
        self.eos_id: int = ids["eos_id"]
        self.pad_id: int = ids["pad_id"]
        self.unk_id: int = ids["unk_id"]
        declared = self.metadata.get("vocab_size")
        if declared is not None and declared != self.vocab_size:
            raise TokenizerError(
                f"{META_FILE} says vocab_size={declared} but the model has {self.vocab_size} "
                "pieces (files from different runs?)"
            )

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer directory, a SentencePiece `.model` file or a `mindloom_tokenizer.json`."""
        p = os.fspath(path)
        if os.path.isfile(p) and os.path.basename(p) == META_FILE:
            p = os.path.dirname(p) or "."
        if os.path.isdir(p):
            meta_path = os.path.join(p, META_FILE)
            meta = _read_metadata(meta_path) if os.path.exists(meta_path) else {}
            model_path = os.path.join(p, MODEL_FILE)
            if meta.get("model_type") == "char":
                vocab_path = os.path.join(p, CHAR_VOCAB_FILE)
                backend = _CharModel.from_file(vocab_path, meta.get("model_sha256"))
                return cls(backend, meta, path=p)
            if os.path.exists(model_path):
                return cls(_load_sentencepiece(model_path, meta), meta, path=p)
            raise TokenizerError(f"no {MODEL_FILE} or {META_FILE} in tokenizer directory {p}")
        if os.path.isfile(p):
            meta_path = os.path.join(os.path.dirname(p) or ".", META_FILE)
            meta = {}
            if os.path.basename(p) == MODEL_FILE and os.path.exists(meta_path):
                meta = _read_metadata(meta_path)
            return cls(_load_sentencepiece(p, meta), meta, path=p)
        raise TokenizerError(f"tokenizer not found: {p}")

    # -- encoding ------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS are added."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if self.model_type == "char":
            return self._backend.encode(text)
        try:
            return self._backend.encode(text, out_type=int)
        except (RuntimeError, TypeError):
            if not _SURROGATE.search(text):
                raise
            return self._backend.encode(_SURROGATE.sub("\ufffd", text), out_type=int)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Encode many texts; SentencePiece spreads them over `num_threads` (default: all CPUs)."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of str, got a single str")
        texts = list(texts)
        if not texts:
            return []
        if self.model_type == "char":
            return [self._backend.encode(t) for t in texts]
        n = default_num_threads() if num_threads is None else int(num_threads)
        if n < 1:
            raise ValueError(f"num_threads must be >= 1, got {n}")
        try:
            return self._backend.encode(texts, out_type=int, num_threads=n)
        except (RuntimeError, TypeError):
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise TypeError(
                        f"encode_batch expects str items, item {i} is {type(t).__name__}"
                    ) from None
            # SentencePiece cannot take a lone surrogate (invalid UTF-16 that JSON allows).
            texts = [_SURROGATE.sub("\ufffd", t) for t in texts]
            return self._backend.encode(texts, out_type=int, num_threads=n)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (special tokens decode to nothing)."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if self.model_type == "char":
            return self._backend.decode(ids)
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise TokenizerError(f"id {i} is out of range for vocab size {n}")
        return self._backend.decode(ids)

    # -- vocabulary ----------------------------------------------------------------------

    def id_to_piece(self, i: int) -> str:
        if not 0 <= int(i) < self.vocab_size:
            raise TokenizerError(f"id {i} is out of range for vocab size {self.vocab_size}")
        if self.model_type == "char":
            return self._backend.pieces[int(i)]
        return self._backend.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        """Id of `piece`, or `unk_id` when the vocabulary does not have it."""
        if self.model_type == "char":
            try:
                return self._backend.pieces.index(piece)
            except ValueError:
                return self.unk_id
        return self._backend.piece_to_id(piece)

    def piece_kinds(self) -> np.ndarray:
        """Per id: 0 normal, 1 unknown, 2 control, 3 byte fallback, 4 user-defined, 5 unused."""
        kinds = np.zeros(self.vocab_size, dtype=np.int8)
        if self.model_type == "char":
            code = {"char": 0, "unk": 1, "control": 2}
            for i, k in enumerate(self._backend.kinds):
                kinds[i] = code[k]
            return kinds
        sp = self._backend
        user = set(self.metadata.get("user_defined_symbols", []))
        for i in range(self.vocab_size):
            if sp.is_unknown(i):
                kinds[i] = 1
            elif sp.is_control(i):
                kinds[i] = 2
            elif sp.is_byte(i):
                kinds[i] = 3
            elif sp.is_unused(i):
                kinds[i] = 5
            elif user and sp.id_to_piece(i) in user:
                kinds[i] = 4
        return kinds

    @property
    def sentencepiece(self):
        """The underlying `sentencepiece.SentencePieceProcessor` (None for `char`)."""
        return None if self.model_type == "char" else self._backend

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model_type={self.model_type!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id}, "
            f"unk_id={self.unk_id}, path={self.path!r})"
        )


def _read_metadata(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return meta


def _spm_model_type(sp) -> str:
    """bpe / unigram / word / char from the model itself (a model trained elsewhere)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb

        m = pb.ModelProto()
        m.ParseFromString(sp.serialized_model_proto())
        return pb.TrainerSpec.ModelType.Name(m.trainer_spec.model_type).lower()
    except Exception:  # protobuf missing or an unusual model: the type is informational
        return "sentencepiece"


def _load_sentencepiece(path: str, meta: dict | None = None):
    import sentencepiece as spm

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TokenizerError(f"cannot read tokenizer model {path}: {exc.strerror or exc}") from None
    if not data:
        raise TokenizerError(f"tokenizer model {path} is empty")
    expected = (meta or {}).get("model_sha256")
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise TokenizerError(
            f"{path} does not match model_sha256 in {META_FILE} (files from different runs?)"
        )
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except Exception as exc:  # sentencepiece raises OSError/RuntimeError with C++ text
        msg = " ".join(str(exc).split())
        raise TokenizerError(
            f"cannot load tokenizer model {path}: not a valid SentencePiece model ({msg})"
        ) from None
    if sp.get_piece_size() <= 0:
        raise TokenizerError(f"tokenizer model {path} has no pieces")
    return sp
