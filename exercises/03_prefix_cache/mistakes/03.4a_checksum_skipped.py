import json

import torch

from global_kv_pool import _HEADER_LEN, MAGIC, KVBlockCorrupt


def deserialize_block(value, shape, dtype, token_ids):
    """Checks the header but never the payload's checksum: flipped bytes load as K/V."""
    if len(value) < _HEADER_LEN.size:
        raise KVBlockCorrupt("value too short")
    magic, header_len = _HEADER_LEN.unpack_from(value)
    if magic != MAGIC:
        raise KVBlockCorrupt("bad magic")
    try:
        header = json.loads(value[_HEADER_LEN.size : _HEADER_LEN.size + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVBlockCorrupt(f"unreadable header: {exc}") from None
    payload = value[_HEADER_LEN.size + header_len :]
    expected = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "token_ids": list(token_ids)}
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expected.items()):
        raise KVBlockCorrupt("header does not describe this block")
    if len(payload) != header.get("nbytes"):
        raise KVBlockCorrupt("payload size mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
