# SPDX-License-Identifier: Apache-2.0
"""Independent pure-Python oracle for kvc-eval's tokenizers (tools/eval/tokenizer.hpp), for its tests.

Written from the algorithms' definitions, not from the C++ code, and deliberately by other means:
  * Hugging Face tokenizer.json (the `tokenizers` library, v0.22 semantics), BPE model: added tokens split out
    (LeftmostLongest; non-normalized ones in the raw text, normalized ones in the normalized text), normalizers
    Prepend/Replace/Sequence, pre-tokenizers Metaspace/ByteLevel/Sequence, BPE by its definition (repeatedly merge
    the lowest-rank adjacent pair, the leftmost on equal rank, rescanning the whole word each time; tokenizers uses
    a heap), decoders Replace/ByteFallback/Fuse/Strip/ByteLevel/Metaspace/Sequence. The GPT-2 split uses Python's
    `re` engine on the pattern itself, with the classes kvc approximates: \\p{L}, \\p{N}, \\s exact for ASCII, every
    non-ASCII code point a letter.
  * llama2.c tokenizer.bin: run.c's encode() (its quadratic rescan loop, literally) and decode().
Only the standard library is used (the `tokenizers` and `sentencepiece` packages are not needed).

Usage:
  tokenizer.py json PATH TEXT...             ids of each TEXT, one line each
  tokenizer.py llama2c PATH VOCAB_SIZE TEXT...
  tokenizer.py cases [--shared DIR]          the expected-value tables of tests/tools/tokenizer_test.cpp (C++)
"""
import argparse
import json
import os
import re
import struct
import sys


# ---- Hugging Face tokenizer.json ---------------------------------------------------------------------------------

def _bytes_to_unicode():
    """GPT-2's table: printable bytes map to themselves, the others to 256, 257, ... in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}

_L = "A-Za-z\u0080-\U0010FFFF"  # kvc's approximation of \p{L}: ASCII letters and every non-ASCII code point
_N = "0-9"
_S = "\t\n\x0b\x0c\r "            # \s restricted to ASCII
GPT2_RE = re.compile(
    "'s|'t|'re|'ve|'m|'ll|'d"
    f"| ?[{_L}]+| ?[{_N}]+| ?[^{_S}{_L}{_N}]+|[{_S}]+(?![^{_S}])|[{_S}]+")


class HFTokenizer:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        model = spec["model"]
        assert model["type"] == "BPE"
        assert model.get("continuing_subword_prefix") is None and model.get("end_of_word_suffix") is None
        self.vocab = dict(model["vocab"])
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.unk = model.get("unk_token")
        self.fuse_unk = bool(model.get("fuse_unk"))
        self.byte_fallback = bool(model.get("byte_fallback"))
        self.ignore_merges = bool(model.get("ignore_merges"))
        self.ranks = {}
        rank = 0
        for m in model["merges"]:
            if isinstance(m, str):
                if m.startswith("#version"):
                    continue
                a, b = m.split(" ")
            else:
                a, b = m
            self.ranks[(a, b)] = rank  # a pair listed twice keeps its last rank
            rank += 1
        self.normalizers = self._flatten(spec.get("normalizer"), "normalizers")
        self.pre_tokenizers = self._flatten(spec.get("pre_tokenizer"), "pretokenizers")
        self.decoder = spec.get("decoder")
        self.decoders = self._flatten(self.decoder, "decoders")
        # Added tokens: ids after the model's vocabulary for contents outside it, in file order.
        self.added = []  # (pattern, id, normalized)
        for t in spec.get("added_tokens") or []:
            if t["content"] not in self.vocab:
                self.id_to_token[t["id"]] = t["content"]
            pattern = self.normalize(t["content"]) if t["normalized"] else t["content"]
            self.added.append((pattern, t["id"], t["normalized"]))

    @staticmethod
    def _flatten(component, key):
        if component is None:
            return []
        if component["type"] == "Sequence":
            return [c for sub in component[key] for c in HFTokenizer._flatten(sub, key)]
        return [component]

    def normalize(self, s):
        for n in self.normalizers:
            if n["type"] == "Prepend":
                s = n["prepend"] + s if s else s
            elif n["type"] == "Replace":
                s = s.replace(n["pattern"]["String"], n["content"])
            else:
                raise ValueError(n["type"])
        return s

    def split_added(self, s, normalized, at_start):
        """LeftmostLongest: the earliest position where some pattern matches, the longest pattern there."""
        out, last, i = [], 0, 0
        patterns = [(p, i_) for p, i_, n in self.added if n == normalized]
        while i < len(s):
            best = None
            for p, tid in patterns:
                if s.startswith(p, i) and (best is None or len(p) > len(best[0])):
                    best = (p, tid)
            if best is None:
                i += 1
                continue
            if i > last:
                out.append((s[last:i], None, at_start and last == 0))
            out.append((best[0], best[1], False))
            i += len(best[0])
            last = i
        if last < len(s):
            out.append((s[last:], None, at_start and last == 0))
        return out

    def pre_tokenize(self, p, text, at_start):
        """One pre-tokenizer on one piece: the non-empty pieces (text, at_start)."""
        if p["type"] == "ByteLevel":
            if p["add_prefix_space"] and not text.startswith(" "):
                text = " " + text
            parts = GPT2_RE.findall(text) if p.get("use_regex", True) else [text]
            assert "".join(parts) == text
            out, offset = [], 0
            for part in parts:
                mapped = "".join(BYTE_TO_CHAR[b] for b in part.encode("utf-8"))
                out.append((mapped, at_start and offset == 0))
                offset += len(part)
            return [(t, a) for t, a in out if t]
        if p["type"] == "Metaspace":
            rep = p["replacement"]
            scheme = p.get("prepend_scheme", "always")
            text = text.replace(" ", rep)
            if (scheme == "always" or (scheme == "first" and at_start)) and not text.startswith(rep):
                text = rep + text
            if not p.get("split", True):
                return [(text, at_start)] if text else []
            parts, current = [], ""
            for ch in text:  # each replacement character starts a new piece
                if ch == rep and current:
                    parts.append(current)
                    current = ""
                current += ch
            if current:
                parts.append(current)
            return [(part, at_start and k == 0) for k, part in enumerate(parts)]
        raise ValueError(p["type"])

    def bpe(self, word):
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        symbols = []  # token strings
        pending_unk = None
        for ch in word:
            if ch in self.vocab:
                if pending_unk is not None:
                    symbols.append(pending_unk)
                    pending_unk = None
                symbols.append(ch)
                continue
            names = ["<0x%02X>" % b for b in ch.encode("utf-8")]
            if self.byte_fallback and all(n in self.vocab for n in names):
                symbols.extend(names)  # a pending unk stays pending (tokenizers' merge_word)
                continue
            if self.unk is not None:
                if pending_unk is not None and not self.fuse_unk:
                    symbols.append(pending_unk)
                pending_unk = self.unk
        if pending_unk is not None:
            symbols.append(pending_unk)
        while True:
            best = None
            for k in range(len(symbols) - 1):
                r = self.ranks.get((symbols[k], symbols[k + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, k)
            if best is None:
                break
            k = best[1]
            symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
        return [self.vocab[s] for s in symbols]

    def encode(self, data):
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        pieces = []
        for t, tid, a in self.split_added(text, False, True):
            if tid is not None:
                pieces.append((t, tid, a))
            else:
                pieces.extend(self.split_added(self.normalize(t), True, a))
        for p in self.pre_tokenizers:
            nxt = []
            for t, tid, a in pieces:
                if tid is not None:
                    nxt.append((t, tid, a))
                else:
                    nxt.extend((u, None, b) for u, b in self.pre_tokenize(p, t, a))
            pieces = nxt
        ids = []
        for t, tid, _ in pieces:
            ids.extend([tid] if tid is not None else self.bpe(t))
        return ids

    def decode(self, ids):
        tokens = [self.id_to_token.get(i, "\ufffd") for i in ids]
        for d in self.decoders:
            tokens = self._decode_step(d, tokens)
        return ("" if self.decoder is not None else " ").join(tokens)

    @staticmethod
    def _byte_token(t):
        """ByteFallback's test: '<0x' + two hex digits (Rust's from_str_radix also takes '+' and one) + '>'."""
        if len(t.encode("utf-8")) != 6 or not t.startswith("<0x") or not t.endswith(">"):
            return None
        digits = t[3:5]
        if re.fullmatch(r"[0-9A-Fa-f]{2}|\+[0-9A-Fa-f]", digits):
            return int(digits.lstrip("+"), 16)
        return None

    def _decode_step(self, d, tokens):
        kind = d["type"]
        if kind == "Replace":
            return [t.replace(d["pattern"]["String"], d["content"]) for t in tokens]
        if kind == "Fuse":
            return ["".join(tokens)]
        if kind == "ByteFallback":
            out, pending = [], bytearray()

            def flush():
                if pending:
                    try:
                        out.append(bytes(pending).decode("utf-8"))
                    except UnicodeDecodeError:
                        out.extend(["\ufffd"] * len(pending))
                    pending.clear()

            for t in tokens:
                b = self._byte_token(t)
                if b is None:
                    flush()
                    out.append(t)
                else:
                    pending.append(b)
            flush()
            return out
        if kind == "Strip":
            out = []
            for t in tokens:
                begin, end = 0, len(t)
                while begin < len(t) and begin < d["start"] and t[begin] == d["content"]:
                    begin += 1
                while end > 0 and len(t) - end < d["stop"] and t[end - 1] == d["content"]:
                    end -= 1
                out.append(t[begin:end] if begin < end else "")
            return out
        if kind == "ByteLevel":
            data = bytearray()
            for t in tokens:
                if all(c in CHAR_TO_BYTE for c in t):
                    data.extend(CHAR_TO_BYTE[c] for c in t)
                else:
                    data.extend(t.encode("utf-8"))
            return [bytes(data).decode("utf-8", errors="replace")]
        if kind == "Metaspace":
            never = d.get("prepend_scheme", "always") == "never"
            return [t.replace(d["replacement"], "" if i == 0 and not never else " ") for i, t in enumerate(tokens)]
        raise ValueError(kind)


# ---- llama2.c tokenizer.bin --------------------------------------------------------------------------------------

class Llama2cTokenizer:
    def __init__(self, path, vocab_size):
        with open(path, "rb") as f:
            data = f.read()
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        pos = 4
        self.pieces, self.scores = [], []
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, pos)
            pos += 8
            self.pieces.append(data[pos:pos + length])
            self.scores.append(score)
            pos += length
        assert pos == len(data)
        self.lookup = {p: i for i, p in enumerate(self.pieces)}
        assert len(self.lookup) == vocab_size

    def encode(self, data):
        """run.c encode(text, bos=0, eos=0)."""
        text = data.encode("utf-8") if isinstance(data, str) else data
        text = text.split(b"\0")[0]
        tokens = [self.lookup[b" "]] if text else []
        i = 0
        while i < len(text):
            n = 1
            while n < 4 and i + n < len(text) and (text[i + n] & 0xC0) == 0x80:
                n += 1
            group = text[i:i + n]
            if group in self.lookup:
                tokens.append(self.lookup[group])
            else:
                tokens.extend(b + 3 for b in group)
            i += n
        while True:
            best_score, best_id, best_idx = -1e10, -1, -1
            for k in range(len(tokens) - 1):
                tid = self.lookup.get(self.pieces[tokens[k]] + self.pieces[tokens[k + 1]], -1)
                if tid != -1 and self.scores[tid] > best_score:
                    best_score, best_id, best_idx = self.scores[tid], tid, k
            if best_idx == -1:
                break
            tokens[best_idx:best_idx + 2] = [best_id]
        return tokens

    def decode(self, ids):
        """The concatenation of run.c decode(prev, id) (bytes)."""
        out = bytearray()
        for k, tid in enumerate(ids):
            if not 0 <= tid < len(self.pieces):
                out.extend("\ufffd".encode("utf-8"))
                continue
            piece = self.pieces[tid]
            if k > 0 and ids[k - 1] == 1 and piece.startswith(b" "):
                piece = piece[1:]
            m = re.match(rb"<0x([0-9A-Fa-f]{1,2})", piece)  # sscanf(piece, "<0x%02hhX>")
            out.extend(bytes([int(m.group(1), 16)]) if m else piece)
        return bytes(out)


# ---- the test tables ---------------------------------------------------------------------------------------------

# The texts of tests/tools/tokenizer_test.cpp (bytes: the last one is not valid UTF-8).
TEXTS = [
    b"Once upon a time, there was a little girl named Lily.",
    b"She said: \"I have 3 cats & 12 dogs!\"\nThey're 100% happy.\n\nThe end.",
    "Caf\u00e9 na\u00efve \U0001F600 \u2014 \u65e5\u672c".encode("utf-8"),
    b"",
    b"<|start_story|>Once upon a time",
    b"Hello <|start_story|> world <|end_story|>",
    b"  two  spaces\tand\ttabs  ",
    b"bad \xff\xfe bytes \xc3",
]


def cpp_string(data):
    """A C++ string literal for `data` (octal escapes: always 3 digits, so a following digit cannot join them)."""
    out = []
    for b in data:
        c = chr(b)
        if c == '"' or c == "\\":
            out.append("\\" + c)
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append("\\%03o" % b)
    return '"' + "".join(out) + '"'


def print_cases(name, tok):
    print(f"// {name}: {{text, ids, decode(ids)}}")
    for text in TEXTS:
        ids = tok.encode(text)
        decoded = tok.decode(ids)
        decoded = decoded.encode("utf-8") if isinstance(decoded, str) else decoded
        print(f"    {{std::string_view({cpp_string(text)}, {len(text)}),")
        print(f"     {{{', '.join(str(i) for i in ids)}}},")
        print(f"     std::string_view({cpp_string(decoded)}, {len(decoded)})}},")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("json")
    j.add_argument("path")
    j.add_argument("texts", nargs="*")
    b = sub.add_parser("llama2c")
    b.add_argument("path")
    b.add_argument("vocab_size", type=int)
    b.add_argument("texts", nargs="*")
    c = sub.add_parser("cases")
    c.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))
    args = ap.parse_args()
    if args.cmd in ("json", "llama2c"):
        tok = HFTokenizer(args.path) if args.cmd == "json" else Llama2cTokenizer(args.path, args.vocab_size)
        for t in args.texts:
            print(" ".join(str(i) for i in tok.encode(t.encode("utf-8", errors="surrogateescape"))))
        return 0
    models = os.path.join(args.shared, "models")
    print_cases("tinystories-656k/tokenizer.json", HFTokenizer(os.path.join(models, "tinystories-656k",
                                                                              "tokenizer.json")))
    print_cases("stories260k/tok512.bin", Llama2cTokenizer(os.path.join(models, "stories260k", "tok512.bin"), 512))
    return 0


if __name__ == "__main__":
    sys.exit(main())
