# SPDX-License-Identifier: Apache-2.0
"""The independent NumPy (float64) reference runner for Llama-architecture models.

It reads two formats into one forward pass (RMSNorm, RoPE, GQA attention, SwiGLU):
  - a Hugging Face Llama folder: config.json + *.safetensors (F32, F16 or BF16), tied or untied embeddings,
    rope_theta, Llama-3 rope_scaling, rms_norm_eps, head_dim; RoPE in rotate-half (NeoX) pairing (i, i + d/2);
  - a llama2.c legacy checkpoint (.bin, e.g. shared/models/stories260k): RoPE in interleaved pairing (2i, 2i + 1),
    theta 10000, RMSNorm eps 1e-5, as in llama2.c's run.c.
It is written from the architecture and the file formats, not from kvc's C++ (tools/eval), so that the C++ runner's
logits can be checked against it.

Usage:
  model.py logits --model PATH --tokens T.npy --out L.npy   float32 logits [N, vocab] for int32/int64 tokens [N]
  model.py selftest                                          checks on shared/models (causality, llama2.c, RoPE)
  model.py [dump] --model PATH --out DIR [--tokens N]        greedy story of N tokens from BOS and its cache:
      DIR/layer<L>/{keys,values,queries,queries_prerope}.npy (float32; keys/values [1, Hkv, N, d], queries
      [1, H, N, d], post-RoPE except queries_prerope, which window-attention policies re-rotate), tokens.npy,
      story.txt.
PATH is a Hugging Face folder, a llama2.c .bin checkpoint, or a folder holding exactly one such checkpoint.
"""
import json
import math
import os
import struct
import sys
import tempfile
import time

import numpy as np


class ModelError(ValueError):
    """A model file or an input that this runner cannot use; the message says which and why."""


# ---------------------------------------------------------------------------------------------------------------
# safetensors: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, the data.

_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def load_safetensors(path):
    """Returns {name: float64 array}; F64/F32/F16 as stored, BF16 widened exactly (it is float32's upper 16 bits)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ModelError(f"{path}: too short to be a safetensors file")
    n = struct.unpack_from("<Q", blob, 0)[0]
    if n > len(blob) - 8:
        raise ModelError(f"{path}: header length {n} runs past the end of the file ({len(blob)} bytes)")
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError as e:
        raise ModelError(f"{path}: header is not JSON: {e}") from None
    data = memoryview(blob)[8 + n :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ModelError(f"{path}: tensor {name} has dtype {info.get('dtype')}; supported: F64, F32, F16, BF16")
        shape = [int(s) for s in info["shape"]]
        start, end = info["data_offsets"]
        if not 0 <= start <= end <= len(data) or end - start != math.prod(shape) * np.dtype(dtype).itemsize:
            raise ModelError(f"{path}: tensor {name}: data_offsets {start}..{end} do not fit shape {shape} {dtype}")
        raw = np.frombuffer(data[start:end], dtype=dtype)
        if info["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.astype(np.float64).reshape(shape)
    return tensors


def save_safetensors(path, tensors):
    """Writes {name: array} as F32 (only the self-test needs a writer: it round-trips a model through the HF path)."""
    header, chunks, offset = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        chunks.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


# ---------------------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(head_dim, theta, scaling=None):
    """Inverse frequencies theta^(-2i/d), i < d/2, with Llama-3 rope_scaling applied when given.

    Llama 3 (transformers' _compute_llama3_parameters): wavelen = 2 pi / inv_freq; long wavelengths
    (> orig / low_freq_factor) are slowed down by `factor`, short ones (< orig / high_freq_factor) kept, and the
    band between interpolated with smooth = (orig / wavelen - low) / (high - low).
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ModelError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
    try:
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        orig = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelError(f"rope_scaling 'llama3' lacks {e}") from None
    if not (factor > 0 and 0 < low < high and orig > 0):
        raise ModelError(f"rope_scaling 'llama3' has unusable values {scaling}")
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return np.where(wavelen > orig / low, inv_freq / factor, np.where(wavelen < orig / high, inv_freq, mid))


def rope(x, pos, inv_freq, style):
    """Rotates x [..., N, d] to positions pos [N]; pair i turns by pos * inv_freq[i].

    "neox" (HF, rotate-half) pairs (i, i + d/2); "interleaved" (llama2.c, Meta's original) pairs (2i, 2i + 1).
    Both are x_a' = x_a cos - x_b sin, x_b' = x_b cos + x_a sin, only the pairing differs.
    """
    ang = pos[:, None] * inv_freq[None, :]  # [N, d/2]
    if style == "neox":
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        half = x.shape[-1] // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        cos, sin = np.cos(ang), np.sin(ang)
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
        return out
    raise ModelError(f"unknown RoPE style {style!r}")


# ---------------------------------------------------------------------------------------------------------------
# The model


class Llama:
    """A Llama decoder held in float64. Build it with Llama.load(path) (or from_hf / from_llama2c).

    Weights are in the [out, in] layout of both formats: layers[l] has attn_norm, wq, wk, wv, wo, ffn_norm,
    w1 (gate), w2 (down), w3 (up); the MLP is w2(silu(w1 h) * w3 h).
    """

    def __init__(self, *, heads, kv_heads, head_dim, eps, inv_freq, rope_style, embed, layers, final_norm, lm_head,
                 max_len, bos, decoder):
        if heads % kv_heads:
            raise ModelError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
        if head_dim % 2:
            raise ModelError(f"head_dim {head_dim} is odd; RoPE needs pairs")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps, self.inv_freq, self.rope_style = eps, inv_freq, rope_style
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.vocab_size = lm_head.shape[0]
        self.max_len, self.bos, self._decoder = max_len, bos, decoder

    # -- loading ----------------------------------------------------------------------------------------------

    @staticmethod
    def load(path):
        """A Hugging Face folder (has config.json), a llama2.c .bin, or a folder with exactly one llama2.c .bin."""
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, "config.json")):
                return Llama.from_hf(path)
            bins = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
            ckpts = [f for f in bins if _llama2c_header(os.path.join(path, f)) is not None]
            if len(ckpts) != 1:
                raise ModelError(f"{path}: no config.json, and {len(ckpts)} llama2.c checkpoints among the .bin "
                                 f"files {bins} (need exactly one)")
            return Llama.from_llama2c(os.path.join(path, ckpts[0]))
        if os.path.isfile(path):
            return Llama.from_llama2c(path)
        raise ModelError(f"{path}: no such file or folder")

    @staticmethod
    def from_hf(model_dir):
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                c = json.load(f)
        except ValueError as e:
            raise ModelError(f"{model_dir}/config.json: not JSON: {e}") from None
        if c.get("model_type", "llama") != "llama":
            raise ModelError(f"{model_dir}: model_type {c.get('model_type')!r} is not 'llama'")
        if c.get("hidden_act", "silu") != "silu":
            raise ModelError(f"{model_dir}: hidden_act {c['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        try:
            hidden, heads, n_layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
        except KeyError as e:
            raise ModelError(f"{model_dir}/config.json lacks {e}") from None
        kv_heads = c.get("num_key_value_heads", heads)
        head_dim = c.get("head_dim") or hidden // heads
        files = ["model.safetensors"] if os.path.exists(os.path.join(model_dir, "model.safetensors")) else sorted(
            f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not files:
            raise ModelError(f"{model_dir}: no .safetensors file")
        w = {}
        for f in files:
            w.update(load_safetensors(os.path.join(model_dir, f)))

        def take(name, shape):
            if name not in w:
                raise ModelError(f"{model_dir}: tensor {name} is missing")
            t = w.pop(name)
            if list(t.shape) != list(shape):
                raise ModelError(f"{model_dir}: tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
            return t

        # Tied embeddings (as transformers ties them: one matrix for both) may be stored under either name:
        # tinystories-656k keeps only lm_head.weight. Untied ones need both. A config without tie_word_embeddings
        # counts as tied exactly when one of the two is absent.
        embed_t, head_t = w.pop("model.embed_tokens.weight", None), w.pop("lm_head.weight", None)
        if embed_t is None and head_t is None:
            raise ModelError(f"{model_dir}: neither model.embed_tokens.weight nor lm_head.weight is present")
        if c.get("tie_word_embeddings", embed_t is None or head_t is None):
            embed = lm_head = embed_t if embed_t is not None else head_t
        elif embed_t is None or head_t is None:
            raise ModelError(f"{model_dir}: tie_word_embeddings is false but "
                             f"{'model.embed_tokens' if embed_t is None else 'lm_head'}.weight is missing")
        else:
            embed, lm_head = embed_t, head_t
        vocab = embed.shape[0]
        for name, t in (("embedding", embed), ("lm_head", lm_head)):
            if list(t.shape) != [vocab, hidden]:
                raise ModelError(f"{model_dir}: {name} has shape {list(t.shape)}, expected [{vocab}, {hidden}]")
        inter = c.get("intermediate_size")
        if inter is None:
            raise ModelError(f"{model_dir}/config.json lacks 'intermediate_size'")
        layers = []
        for i in range(n_layers):
            p = f"model.layers.{i}."
            layers.append({
                "attn_norm": take(p + "input_layernorm.weight", [hidden]),
                "wq": take(p + "self_attn.q_proj.weight", [heads * head_dim, hidden]),
                "wk": take(p + "self_attn.k_proj.weight", [kv_heads * head_dim, hidden]),
                "wv": take(p + "self_attn.v_proj.weight", [kv_heads * head_dim, hidden]),
                "wo": take(p + "self_attn.o_proj.weight", [hidden, heads * head_dim]),
                "ffn_norm": take(p + "post_attention_layernorm.weight", [hidden]),
                "w1": take(p + "mlp.gate_proj.weight", [inter, hidden]),
                "w2": take(p + "mlp.down_proj.weight", [hidden, inter]),
                "w3": take(p + "mlp.up_proj.weight", [inter, hidden]),
            })
        final_norm = take("model.norm.weight", [hidden])
        # Anything left (biases, extra norms) belongs to an architecture this runner does not compute: say so
        # rather than silently ignore it. rotary_emb.inv_freq is a cached buffer some old exports carry.
        left = sorted(n for n in w if not n.endswith("rotary_emb.inv_freq"))
        if left:
            raise ModelError(f"{model_dir}: unexpected tensors {left[:5]}{' ...' if len(left) > 5 else ''}")
        try:
            inv_freq = rope_inv_freq(head_dim, float(c.get("rope_theta", 10000.0)), c.get("rope_scaling"))
        except ModelError as e:
            raise ModelError(f"{model_dir}/config.json: {e}") from None
        return Llama(heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=float(c.get("rms_norm_eps", 1e-6)),
                     inv_freq=inv_freq, rope_style="neox", embed=embed, layers=layers, final_norm=final_norm,
                     lm_head=lm_head,
                     max_len=c.get("max_position_embeddings"), bos=c.get("bos_token_id", 1),
                     decoder=_hf_decoder(os.path.join(model_dir, "tokenizer.json")))

    @staticmethod
    def from_llama2c(path):
        """llama2.c's legacy format, as run.c reads it: header, then float32 weights in a fixed order."""
        h = _llama2c_header(path)
        if h is None:
            raise ModelError(f"{path}: not a llama2.c checkpoint (the 7-int32 header does not match the file size)")
        dim, hidden, n_layers, heads, kv_heads, vocab, seq_len, shared = h
        hd = dim // heads
        kv_dim = kv_heads * hd
        data = np.fromfile(path, dtype="<f4", offset=28).astype(np.float64)
        pos = 0

        def take(*shape):
            nonlocal pos
            n = math.prod(shape)
            t = data[pos : pos + n].reshape(shape)
            pos += n
            return t

        embed = take(vocab, dim)
        rms_att = take(n_layers, dim)
        wq, wk, wv = take(n_layers, dim, dim), take(n_layers, kv_dim, dim), take(n_layers, kv_dim, dim)
        wo = take(n_layers, dim, dim)
        rms_ffn = take(n_layers, dim)
        w1, w2, w3 = take(n_layers, hidden, dim), take(n_layers, dim, hidden), take(n_layers, hidden, dim)
        final_norm = take(dim)
        take(2, seq_len, hd // 2)  # freq_cis_real, freq_cis_imag: precomputed RoPE tables run.c no longer reads
        lm_head = embed if shared else take(vocab, dim)
        assert pos == data.size  # _llama2c_header checked the size
        layers = [{"attn_norm": rms_att[i], "wq": wq[i], "wk": wk[i], "wv": wv[i], "wo": wo[i],
                   "ffn_norm": rms_ffn[i], "w1": w1[i], "w2": w2[i], "w3": w3[i]} for i in range(n_layers)]
        return Llama(heads=heads, kv_heads=kv_heads, head_dim=hd, eps=1e-5, inv_freq=rope_inv_freq(hd, 10000.0),
                     rope_style="interleaved", embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head,
                     max_len=seq_len, bos=1, decoder=_llama2c_decoder(os.path.dirname(path) or ".", vocab))

    # -- forward --------------------------------------------------------------------------------------------

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def forward(self, tokens):
        """Full causal forward over `tokens` (positions 0..N-1); returns logits [N, vocab] and, per layer,
        (q, k, v, q_prerope) shaped [1, heads, N, d] (k, v with kv_heads)."""
        tokens = np.asarray(tokens)
        n, d = len(tokens), self.head_dim
        pos = np.arange(n, dtype=np.float64)
        x = self.embed[tokens]
        caches = []
        g = self.heads // self.kv_heads  # query head h reads KV head h // g
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for L in self.layers:
            h = self.rms(x, L["attn_norm"])
            q = (h @ L["wq"].T).reshape(n, self.heads, d).transpose(1, 0, 2)
            k = (h @ L["wk"].T).reshape(n, self.kv_heads, d).transpose(1, 0, 2)
            v = (h @ L["wv"].T).reshape(n, self.kv_heads, d).transpose(1, 0, 2)
            q_pre = q
            q, k = rope(q, pos, self.inv_freq, self.rope_style), rope(k, pos, self.inv_freq, self.rope_style)
            caches.append((q[None], k[None], v[None], q_pre[None]))
            kk, vv = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
            s = q @ kk.transpose(0, 2, 1) / np.sqrt(d) + mask
            s -= s.max(-1, keepdims=True)
            a = np.exp(s)
            a /= a.sum(-1, keepdims=True)
            o = (a @ vv).transpose(1, 0, 2).reshape(n, -1)
            x = x + o @ L["wo"].T
            h = self.rms(x, L["ffn_norm"])
            gate, up = h @ L["w1"].T, h @ L["w3"].T
            x = x + ((gate / (1 + np.exp(-gate))) * up) @ L["w2"].T
        x = self.rms(x, self.final_norm)
        return x @ self.lm_head.T, caches

    def generate(self, n_tokens, start=None):
        """Greedy: [start] followed by argmax continuations, n_tokens in all (a full forward per step: slow, plain)."""
        tokens = [self.bos if start is None else start]
        while len(tokens) < n_tokens:
            logits, _ = self.forward(np.array(tokens))
            tokens.append(int(np.argmax(logits[-1])))
        return np.array(tokens)

    def decode(self, tokens):
        return self._decoder(tokens) if self._decoder else ""


# ---------------------------------------------------------------------------------------------------------------
# llama2.c files and tokenizers


def _llama2c_header(path):
    """(dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared) if path is a llama2.c checkpoint, else None.

    The header has no magic number, so a file counts as a checkpoint only when its size is exactly what the
    header implies (this also tells a checkpoint from tok512.bin lying next to it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(28)
    except OSError:
        return None
    if len(head) < 28:
        return None
    dim, hidden, n_layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", head)
    shared = vocab > 0  # llama2.c: a negative vocab_size flags an unshared classifier
    vocab = abs(vocab)
    if min(dim, hidden, n_layers, heads, kv_heads, vocab, seq_len) <= 0 or dim % heads or heads % kv_heads:
        return None
    hd, kv_dim = dim // heads, kv_heads * (dim // heads)
    floats = (vocab * dim + n_layers * (2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim) + dim
              + seq_len * hd + (0 if shared else vocab * dim))
    if size != 28 + 4 * floats:
        return None
    return dim, hidden, n_layers, heads, kv_heads, vocab, seq_len, shared


def _read_llama2c_tokenizer(path, vocab):
    """tokenizer .bin: int32 max_token_length, then per token: float32 score, int32 length, bytes. None if not one."""
    with open(path, "rb") as f:
        blob = f.read()
    pieces, off = [], 4
    try:
        for _ in range(vocab):
            _score, n = struct.unpack_from("<fi", blob, off)
            if n < 0 or off + 8 + n > len(blob):
                return None
            pieces.append(blob[off + 8 : off + 8 + n])
            off += 8 + n
    except struct.error:
        return None
    return pieces if off == len(blob) else None


def _llama2c_decoder(folder, vocab):
    """Decodes as run.c prints: <0xNN> pieces are raw bytes, a leading space after BOS (1) is dropped, and BOS
    itself prints nothing (run.c never prints its prompt BOS and stops when the model emits BOS again)."""
    pieces = None
    for f in sorted(os.listdir(folder)):
        if f.endswith(".bin") and _llama2c_header(os.path.join(folder, f)) is None:
            pieces = _read_llama2c_tokenizer(os.path.join(folder, f), vocab)
            if pieces is not None:
                break
    if pieces is None:
        return None

    def decode(tokens):
        out, prev = b"", None
        for t in (int(t) for t in tokens):
            piece = pieces[t]
            if t != 1:
                if prev == 1 and piece.startswith(b" "):
                    piece = piece[1:]
                if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
                    piece = bytes([int(piece[3:5], 16)])
                out += piece
            prev = t
        return out.decode("utf-8", errors="replace")

    return decode


def _hf_decoder(path):
    """tokenizer.json's vocabulary, pieces joined with the SentencePiece/byte-level space markers undone."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        v = json.load(f)["model"]["vocab"]
    vocab = {i: s for s, i in v.items()}

    def decode(tokens):
        text = "".join(vocab.get(int(t), "?") for t in tokens)
        return text.replace("\u2581", " ").replace("\u0120", " ").replace("\u010a", "\n")

    return decode


# ---------------------------------------------------------------------------------------------------------------
# Commands


def dump(model_dir, out_dir, n_tokens=256):
    """Writes layer<L>/{keys,values,queries,queries_prerope}.npy (float32) and tokens.npy, story.txt into out_dir."""
    m = Llama.load(model_dir)
    tokens = m.generate(n_tokens)
    _, caches = m.forward(tokens)
    os.makedirs(out_dir, exist_ok=True)
    np.save(os.path.join(out_dir, "tokens.npy"), tokens.astype(np.int64))
    with open(os.path.join(out_dir, "story.txt"), "w") as f:
        f.write(m.decode(tokens))
    for layer, (q, k, v, q_pre) in enumerate(caches):
        d = os.path.join(out_dir, f"layer{layer}")
        os.makedirs(d, exist_ok=True)
        np.save(os.path.join(d, "keys.npy"), k.astype(np.float32))
        np.save(os.path.join(d, "values.npy"), v.astype(np.float32))
        np.save(os.path.join(d, "queries.npy"), q.astype(np.float32))
        np.save(os.path.join(d, "queries_prerope.npy"), q_pre.astype(np.float32))
    return tokens


def logits_command(model_path, tokens_path, out_path):
    m = Llama.load(model_path)
    try:
        tokens = np.load(tokens_path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ModelError(f"{tokens_path}: cannot read as .npy: {e}") from None
    if tokens.dtype not in (np.int32, np.int64) or tokens.ndim != 1 or tokens.size == 0:
        raise ModelError(f"{tokens_path}: need a non-empty 1-D int32/int64 array, got {tokens.dtype} {tokens.shape}")
    bad = np.flatnonzero((tokens < 0) | (tokens >= m.vocab_size))
    if bad.size:
        raise ModelError(f"{tokens_path}: token {int(tokens[bad[0]])} at index {bad[0]} is outside the vocabulary "
                         f"[0, {m.vocab_size})")
    if m.max_len and tokens.size > m.max_len:
        print(f"warning: {tokens.size} tokens exceed the model's context of {m.max_len}: positions past it are out "
              f"of distribution (the logits are still the exact forward)", file=sys.stderr)
    logits, _ = m.forward(tokens.astype(np.int64))
    try:
        with open(out_path, "wb") as f:  # an open file: np.save would append ".npy" to a path lacking it
            np.save(f, logits.astype(np.float32))
    except OSError as e:
        raise ModelError(f"{out_path}: cannot write: {e.strerror}") from None


# Greedy output of llama2.c's run.c on stories260K from BOS (-t 0.0), the first sentences of the expected text in
# llama2.c's test_all.py (run.c and its PyTorch model both produce it).
LLAMA2C_STORIES260K_GREEDY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
                              "the park. One day, she saw a big, red ball. She wanted to play with it, but it was "
                              "too high.")


def selftest(models_dir):
    failures = []

    def check(ok, what):
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failures.append(what)

    # (c) RoPE by hand: v = (1, 2, 3, 4), d = 4, position 1, theta 10000 -> inv_freq (1, 10000^(-2/4)) = (1, 0.01).
    # interleaved pairs (v0, v1) at angle 1 and (v2, v3) at angle 0.01:
    #   (cos1 - 2 sin1, sin1 + 2 cos1, 3 cos.01 - 4 sin.01, 3 sin.01 + 4 cos.01)
    # with cos1 = 0.5403023058681398, sin1 = 0.8414709848078965, cos.01 = 0.9999500004166653,
    # sin.01 = 0.009999833334166664. Rotate-half pairs (v0, v2) and (v1, v3) instead, so feeding it the permuted
    # vector (v0, v2, v1, v3) = (1, 3, 2, 4) gives the same numbers in the order (0, 2, 1, 3).
    print("RoPE (4-dim example, position 1, theta 10000)")
    expect = np.array([-1.1426396637476532, 1.922075596544176, 2.9598506679133294, 4.029799501669161])
    inv, p1 = rope_inv_freq(4, 10000.0), np.array([1.0])
    inter = rope(np.array([[1.0, 2, 3, 4]]), p1, inv, "interleaved")[0]
    neox = rope(np.array([[1.0, 3, 2, 4]]), p1, inv, "neox")[0]
    check(np.abs(inter - expect).max() < 1e-14, f"interleaved(1,2,3,4) = {np.round(inter, 6)}")
    check(np.abs(neox - expect[[0, 2, 1, 3]]).max() < 1e-14, f"rotate-half(1,3,2,4) = {np.round(neox, 6)}")

    # Llama-3 scaling by hand: d = 6, theta 10000 -> inv_freq (1, 10000^(-1/3), 10000^(-2/3))
    # = (1, 0.0464158883, 0.0021544347), wavelengths 2 pi / f = (6.283, 135.367, 2916.4).
    # factor 8, low 1, high 4, original 500: low_freq_wavelen 500, high_freq_wavelen 125, so the first is kept,
    # the third divided by 8 (0.00026930434) and the second interpolated:
    # smooth = (500 / 135.367 - 1) / 3 = 0.897886, f = 0.0464158883 (smooth + (1 - smooth) / 8) = 0.04226865.
    scaled = rope_inv_freq(6, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 500})
    check(np.abs(scaled - [1.0, 0.04226865, 0.00026930434]).max() < 1e-8, f"llama3 rope_scaling inv_freq = {scaled}")

    # BF16/F16 decoding from hand-made bit patterns: bf16 0x3FC0 = 1.5, 0xC000 = -2; f16 0x3C00 = 1,
    # 0x3555 = 1 + 341/1024 times 2^-2 = 0.333251953125.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.safetensors")
        h = json.dumps({"b": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                        "h": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + struct.pack("<4H", 0x3FC0, 0xC000, 0x3C00, 0x3555))
        t = load_safetensors(path)
        check(list(t["b"]) == [1.5, -2.0] and list(t["h"]) == [1.0, 0.333251953125],
              f"safetensors BF16 -> {list(t['b'])}, F16 -> {list(t['h'])}")

    # (a) causality on tinystories-656k: row i of the full forward equals the last row of the forward on the
    # first i + 1 tokens, and changing token m changes row m but no row before it.
    hf_dir = os.path.join(models_dir, "tinystories-656k")
    print(f"tinystories-656k ({hf_dir})")
    if not os.path.isdir(hf_dir):
        check(False, f"{hf_dir} is missing")
    else:
        m = Llama.load(hf_dir)
        toks = np.random.default_rng(0).integers(3, m.vocab_size, 48)
        full, _ = m.forward(toks)
        worst = max(np.abs(m.forward(toks[:i])[0][-1] - full[i - 1]).max() for i in (1, 2, 17, 48))
        check(worst < 1e-10, f"prefix forwards (1, 2, 17, 48 tokens) match the full forward's rows: {worst:.1e}")
        changed = toks.copy()
        changed[30] = 3 if toks[30] != 3 else 4
        other, _ = m.forward(changed)
        before, at = np.abs(other[:30] - full[:30]).max(), np.abs(other[30] - full[30]).max()
        check(before < 1e-10 and at > 1e-3, f"changing token 30: rows < 30 move {before:.1e}, row 30 moves {at:.2f}")
        t0 = time.perf_counter()
        story = m.generate(41)
        print(f"  greedy from BOS, 40 tokens ({time.perf_counter() - t0:.2f} s): {story[1:].tolist()}")
        print(f"  text: {m.decode(story)!r}")

    # (b) stories260k: llama2.c format, interleaved RoPE; greedy from BOS must reproduce run.c's known output.
    ckpt = os.path.join(models_dir, "stories260k")
    print(f"stories260k ({ckpt})")
    if not os.path.isdir(ckpt):
        check(False, f"{ckpt} is missing")
    else:
        m = Llama.load(ckpt)
        t0 = time.perf_counter()
        story = m.generate(41)
        text = m.decode(story)
        print(f"  greedy from BOS, 40 tokens ({time.perf_counter() - t0:.2f} s): {story[1:].tolist()}")
        print(f"  text: {text!r}")
        check(len(text) > 100 and LLAMA2C_STORIES260K_GREEDY.startswith(text),
              "the text is a prefix of llama2.c run.c's greedy output (test_all.py)")
        # The same weights through the Hugging Face path: rows of wq/wk permuted within each head from
        # (0, 1, 2, 3, ...) to (0, 2, ..., 1, 3, ...) turn interleaved pairs into rotate-half pairs, and q.k is
        # unchanged when q and k are permuted alike. Untied lm_head, explicit head_dim and eps 1e-5 exercise those
        # config paths; the logits must agree to float32 storage (the weights were float32 to begin with).
        d = m.head_dim
        perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
        rows = lambda heads: (np.arange(heads)[:, None] * d + perm[None, :]).ravel()  # noqa: E731
        with tempfile.TemporaryDirectory() as tmp:
            t = {"model.embed_tokens.weight": m.embed, "lm_head.weight": m.lm_head, "model.norm.weight": m.final_norm}
            for i, L in enumerate(m.layers):
                p = f"model.layers.{i}."
                t.update({p + "input_layernorm.weight": L["attn_norm"], p + "post_attention_layernorm.weight":
                          L["ffn_norm"], p + "self_attn.q_proj.weight": L["wq"][rows(m.heads)],
                          p + "self_attn.k_proj.weight": L["wk"][rows(m.kv_heads)], p + "self_attn.v_proj.weight":
                          L["wv"], p + "self_attn.o_proj.weight": L["wo"], p + "mlp.gate_proj.weight": L["w1"],
                          p + "mlp.down_proj.weight": L["w2"], p + "mlp.up_proj.weight": L["w3"]})
            save_safetensors(os.path.join(tmp, "model.safetensors"), t)
            hidden, inter = m.embed.shape[1], m.layers[0]["w1"].shape[0]
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({"model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
                           "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads, "head_dim": d,
                           "num_hidden_layers": len(m.layers), "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                           "tie_word_embeddings": False, "vocab_size": m.vocab_size}, f)
            hf = Llama.load(tmp)
        check(hf.rope_style == "neox" and hf.lm_head is not hf.embed, "re-saved as a HF folder: rotate-half, untied")
        diff = np.abs(hf.forward(story)[0] - m.forward(story)[0]).max()
        check(diff < 1e-9, f"its logits match the llama2.c path: {diff:.1e}")

    print("selftest:", "PASSED" if not failures else f"FAILED ({len(failures)}): {failures}")
    return not failures


def main(argv):
    import argparse

    default_models = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "models")
    cmd = argv[0] if argv and argv[0] in ("dump", "logits", "selftest") else "dump"  # bare flags: the old dump CLI
    args = argv[1:] if argv and argv[0] == cmd else argv
    ap = argparse.ArgumentParser(prog=f"model.py {cmd}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if cmd == "selftest":
        ap.add_argument("--models", default=os.path.normpath(default_models), help="the shared/models folder")
    else:
        ap.add_argument("--model", required=True, help="HF folder, llama2.c .bin, or a folder with one .bin")
        ap.add_argument("--out", required=True, help="output folder (dump) or .npy file (logits)")
        if cmd == "dump":
            ap.add_argument("--tokens", type=int, default=256, help="story length in tokens, BOS included")
        else:
            ap.add_argument("--tokens", required=True, help=".npy file with a 1-D int32/int64 token array")
    a = ap.parse_args(args)
    try:
        if cmd == "selftest":
            return 0 if selftest(a.models) else 1
        if cmd == "logits":
            logits_command(a.model, a.tokens, a.out)
            return 0
        if a.tokens < 1:
            raise ModelError(f"--tokens {a.tokens}: need at least 1")
        dump(a.model, a.out, a.tokens)
        with open(os.path.join(a.out, "story.txt")) as f:
            print(f.read())
        return 0
    except (ModelError, OSError) as e:
        print(f"model.py {cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
