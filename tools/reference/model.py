# SPDX-License-Identifier: Apache-2.0
"""A small NumPy runner for the Hugging Face Llama checkpoint in shared/models/tinystories-656k.

It generates a story greedily from <|start_story|> and returns, per layer, the cache an engine would hold:
post-RoPE keys [1, Hkv, N, d], values [1, Hkv, N, d], post-RoPE queries [1, H, N, d] and the same queries before
RoPE (what window-attention policies re-rotate). Written from the Llama architecture (RMSNorm, rotate-half RoPE,
GQA, SwiGLU); the checkpoint is float32.
"""
import json
import os
import struct

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, expected F32")
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return tensors


class TinyLlama:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = load_safetensors(os.path.join(model_dir, "model.safetensors"))
        c = self.cfg
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.dim = c["hidden_size"] // self.heads
        self.layers = c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        self.inv_freq = c["rope_theta"] ** (-np.arange(0, self.dim, 2) / self.dim)
        self.embed = self.w.get("model.embed_tokens.weight", self.w["lm_head.weight"])
        vocab_path = os.path.join(model_dir, "tokenizer.json")
        self.vocab = None
        if os.path.exists(vocab_path):
            with open(vocab_path) as f:
                v = json.load(f)["model"]["vocab"]
            self.vocab = {i: s for s, i in v.items()}

    def rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos):  # x [..., N, d], rotate-half pairing (i, i + d/2)
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        half = self.dim // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def forward(self, tokens):
        """Full causal forward over `tokens`; returns logits [N, vocab] and per-layer (q, k, v, q_prerope)."""
        n = len(tokens)
        pos = np.arange(n, dtype=np.float64)
        x = self.embed[tokens]
        caches = []
        g = self.heads // self.kv_heads
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            h = self.rms(x, self.w[p + "input_layernorm.weight"])
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).reshape(n, self.heads, self.dim).transpose(1, 0, 2)
            k = (h @ self.w[p + "self_attn.k_proj.weight"].T).reshape(n, self.kv_heads, self.dim).transpose(1, 0, 2)
            v = (h @ self.w[p + "self_attn.v_proj.weight"].T).reshape(n, self.kv_heads, self.dim).transpose(1, 0, 2)
            q_pre = q
            q, k = self.rope(q, pos), self.rope(k, pos)
            caches.append((q[None], k[None], v[None], q_pre[None]))
            kk, vv = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
            logits = q @ kk.transpose(0, 2, 1) / np.sqrt(self.dim) + mask
            logits -= logits.max(-1, keepdims=True)
            a = np.exp(logits)
            a /= a.sum(-1, keepdims=True)
            o = (a @ vv).transpose(1, 0, 2).reshape(n, -1)
            x = x + o @ self.w[p + "self_attn.o_proj.weight"].T
            h = self.rms(x, self.w[p + "post_attention_layernorm.weight"])
            gate = h @ self.w[p + "mlp.gate_proj.weight"].T
            up = h @ self.w[p + "mlp.up_proj.weight"].T
            x = x + ((gate / (1 + np.exp(-gate))) * up) @ self.w[p + "mlp.down_proj.weight"].T
        x = self.rms(x, self.w["model.norm.weight"])
        return x @ self.w["lm_head.weight"].T, caches

    def generate(self, n_tokens, start=1):
        tokens = [start]
        while len(tokens) < n_tokens:
            logits, _ = self.forward(np.array(tokens))
            tokens.append(int(np.argmax(logits[-1])))
        return np.array(tokens)

    def decode(self, tokens):
        if self.vocab is None:
            return ""
        text = "".join(self.vocab.get(int(t), "?") for t in tokens)
        return text.replace("\u2581", " ").replace("\u0120", " ").replace("\u010a", "\n")


def dump(model_dir, out_dir, n_tokens=256):
    """Writes layer<L>/{keys,values,queries,queries_prerope}.npy (float32) and tokens.npy, story.txt into out_dir."""
    m = TinyLlama(model_dir)
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


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="folder with config.json and model.safetensors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    dump(a.model, a.out, a.tokens)
    print(open(os.path.join(a.out, "story.txt")).read())
