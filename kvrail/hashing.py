"""The one block-hash function, shared by the router and the workers.

A prompt is cut into full blocks of `block_size` token ids; block i's hash covers its parent's
hash and its own tokens, so equal hashes mean equal prefixes. The chain starts from a seed derived
from the model fingerprint and the tenant salt: different models or different tenants never share
a hash, hence never share cached KV. Partial trailing blocks get no hash (they are not cacheable).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_VERSION = 1
_DIGEST_BYTES = 16


def root_hash(fingerprint_digest: str, tenant_salt: str = "") -> bytes:
    """The chain's seed for one model fingerprint and one tenant (empty salt: no tenant)."""
    if not fingerprint_digest:
        raise ValueError("root_hash needs the model fingerprint digest")
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"kvrail-root")
    h.update(HASH_VERSION.to_bytes(2, "little"))
    h.update(fingerprint_digest.encode())
    h.update(b"\x00")
    h.update(tenant_salt.encode())
    return h.digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block given its parent's hash."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES, person=b"kvrail-block")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, root: bytes, *, start: int = 0
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `root`.

    `start` skips that many leading full blocks whose hashes the caller already has; pass the last
    of them as `root` to extend a chain incrementally (as a decode step fills a block).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    hashes: list[bytes] = []
    parent = root
    num_full = len(token_ids) // block_size
    for i in range(start, num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
