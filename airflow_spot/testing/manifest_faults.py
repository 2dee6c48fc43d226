"""Manifest corruption campaign: damage one (or every) checkpoint manifest of a store, restore, judge.

Used by the chaos suite (``tests/chaos/test_chaos_manifests.py``, >= 1,000 cases) and by a small
deterministic run in the normal suite. Each case corrupts manifests in place, runs
``CheckpointStore.restore_latest`` and ``latest_step``, then puts the original bytes back, so one store
with several checkpoints serves every case.

A case's verdict:

* ``correct``: restored the newest checkpoint whose manifest is intact (its payload matching), or
  raised :class:`NoUsableCheckpointError` when no intact one exists;
* ``wrong_restore``: restored anything else (another step, or a payload that is not that step's);
* ``silent_restart``: returned "no checkpoint" although checkpoints exist;
* ``refused``: raised although an intact checkpoint existed (progress not lost, but not resumed either);
* ``wrong_latest``: ``latest_step`` disagreed with the restore (a segment could look done, or the job fresh);
* ``latest_ahead_unhashed``: the one known, reported gap: ``latest_step`` checks manifests and payload
  sizes but does not re-hash payloads, so a re-checksummed manifest naming a wrong sha256 makes it report
  a step that restore then (correctly) skips;
* ``harmless_damage_accepted`` (right): the damaged manifest still verifies and still restores its own
  step's state (e.g. a removed ``meta`` field, re-checksummed).

"Intact" is judged semantically: a corrupted manifest whose JSON still equals the original (e.g. a flipped
bit turning ``1e-05`` into ``1E-05``) is the same manifest, and restoring it is correct.
"""
from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass

from airflow_spot.storage.block_digest import MIN_BLOCK_BYTES
from airflow_spot.storage.checkpoint import (
    MANIFEST,
    CheckpointStore,
    NoUsableCheckpointError,
    manifest_checksum,
)

KINDS = (
    "bit_flip", "truncate", "step", "size", "sha256", "sha256_block", "directory", "writer", "remove_field", "swap",
    "not_an_object", "empty",
)
#: verdicts that are right (see the module docstring); "latest_ahead_unhashed" is counted on its own
OK_VERDICTS = ("correct", "fell_back", "raised_no_intact", "harmless_damage_accepted")
#: wrong-but-valid JSON edits that a forger (or a buggy tool) could re-checksum; the cross-checks must hold
RESEALABLE = ("step", "size", "sha256", "sha256_block", "directory", "writer", "remove_field")


#: a payload spans three blocks of the smallest digest block size, which :func:`build_store` saves with, so a
#: manifest naming another block size names another digest
PAYLOAD_BYTES = 3 * MIN_BLOCK_BYTES + 123


def payload_for(step: int) -> bytes:
    line = f"state of step {step}\n".encode()
    return (line * (PAYLOAD_BYTES // len(line) + 1))[:PAYLOAD_BYTES]


def build_store(ckpts: CheckpointStore, steps: list[int]) -> list[str]:
    """Save one checkpoint per step, with digests of the smallest block size (set on ``ckpts``); returns
    their manifest keys, oldest first."""
    ckpts.block_bytes = MIN_BLOCK_BYTES
    return [f"{ckpts.save(step, lambda f, s=step: f.write(payload_for(s))).directory}/{MANIFEST}" for step in steps]


def corrupt(raw: bytes, others: list[bytes], kind: str, rng: random.Random) -> tuple[bytes, str]:
    """One damaged version of manifest ``raw``; ``others`` are the store's other manifests (for swaps)."""
    if kind == "bit_flip":
        data = bytearray(raw)
        flips = 1 if rng.random() < 0.7 else rng.randint(2, 8)
        for _ in range(flips):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data), f"{kind}x{flips}"
    if kind == "truncate":
        return raw[: rng.randrange(len(raw))], kind
    if kind == "swap":
        return rng.choice(others), kind
    if kind == "not_an_object":
        return json.dumps(rng.choice([[], 0, "manifest", None, [json.loads(raw)]])).encode(), kind
    if kind == "empty":
        return b"", kind
    d = json.loads(raw)
    entry = d["files"][0]
    if kind == "step":
        d["step"] = max(0, d["step"] + rng.choice([-100, -80, -1, 1, 8, 80, 100, 1000])) or d["step"] + 1
    elif kind == "size":
        entry["size"] = max(0, entry["size"] + rng.choice([-7, -1, 1, 64])) or entry["size"] + 1
    elif kind == "sha256":
        pos = rng.randrange(64)
        digest = entry["sha256"]
        entry["sha256"] = digest[:pos] + ("0" if digest[pos] != "0" else "1") + digest[pos + 1:]
    elif kind == "sha256_block":  # another block size, or none (the digest read as a whole-file sha256)
        block = entry.get("sha256_block", 0)
        choice = rng.choice([0, block * 2, block // 2 if block >= 2 * MIN_BLOCK_BYTES else block * 4])
        if choice:
            entry["sha256_block"] = choice
        else:
            entry.pop("sha256_block", None)
    elif kind == "directory":
        d["directory"] = d["directory"][:-1] + ("0" if d["directory"][-1] != "0" else "1")
    elif kind == "writer":
        d["writer"] += "x"
    elif kind == "remove_field":
        del d[rng.choice(sorted(d))]
    resealed = kind in RESEALABLE and rng.random() < 0.5
    if resealed:
        d["checksum"] = manifest_checksum(d)
    return json.dumps(d, sort_keys=True).encode(), kind + ("+resealed" if resealed else "")


def _intact(original: bytes, damaged: bytes) -> bool:
    try:
        return json.loads(damaged) == json.loads(original)
    except ValueError:
        return False


@dataclass
class CampaignResult:
    cases: int
    verdicts: Counter
    kinds: Counter
    failures: list[str]

    def summary(self, label: str) -> str:
        v = self.verdicts
        return (
            f"manifest chaos [{label}]: {self.cases} corruptions "
            f"({', '.join(f'{k} {n}' for k, n in sorted(self.kinds.items()))})"
            f" -> wrong restores {v['wrong_restore']}, silent restarts {v['silent_restart']}, "
            f"refused with an intact checkpoint {v['refused']}, wrong latest_step {v['wrong_latest']}, "
            f"correct {v['correct']} (of which fell back to an older checkpoint {v['fell_back']}, "
            f"raised NoUsableCheckpointError {v['raised_no_intact']}, harmless damage accepted "
            f"{v['harmless_damage_accepted']}); latest_step ahead of restore on a re-checksummed wrong sha256 "
            f"{v['latest_ahead_unhashed']}"
        )


def run_campaign(ckpts: CheckpointStore, keys: list[str], cases: int, seed: int) -> CampaignResult:
    """Run ``cases`` corruptions against the checkpoints whose manifest keys are ``keys`` (oldest first,
    as :func:`build_store` returns them; their steps must be distinct and increasing)."""
    rng = random.Random(seed)
    originals = [ckpts.store.get_bytes(k) for k in keys]
    steps = [json.loads(raw)["step"] for raw in originals]
    verdicts: Counter = Counter()
    kinds: Counter = Counter()
    failures: list[str] = []
    for case in range(cases):
        # Mostly one manifest; sometimes every manifest, so "none intact" must raise, not restart.
        targets = list(range(len(keys))) if rng.random() < 0.1 else [rng.randrange(len(keys))]
        damaged = {}
        for i in targets:
            others = [raw for j, raw in enumerate(originals) if j != i]
            damaged[i], kind = corrupt(originals[i], others, rng.choice(KINDS), rng)
            kinds[kind.split("x")[0] if kind.startswith("bit_flip") else kind] += 1
        try:
            for i, raw in damaged.items():
                ckpts.store.put_bytes(keys[i], raw)
            intact = [i for i in range(len(keys)) if i not in damaged or _intact(originals[i], damaged[i])]
            expected = steps[intact[-1]] if intact else None
            verdict = _judge(ckpts, expected, steps[-1])
        finally:
            for i in damaged:
                ckpts.store.put_bytes(keys[i], originals[i])
        verdicts[verdict.split(" ")[0]] += 1
        if verdict in OK_VERDICTS:
            if verdict != "correct":
                verdicts["correct"] += 1
        elif verdict != "latest_ahead_unhashed":
            tails = [damaged[i][-160:] for i in damaged]
            failures.append(f"case {case}: {verdict}; damaged {sorted(damaged)} -> {tails}")
    return CampaignResult(cases, verdicts, kinds, failures)


def _judge(ckpts: CheckpointStore, expected: int | None, newest: int) -> str:
    try:
        restored = ckpts.restore_latest(lambda path: open(path, "rb").read())
    except NoUsableCheckpointError:
        if expected is not None:
            return "refused"
        try:
            latest = ckpts.latest_step()
        except NoUsableCheckpointError:
            return "raised_no_intact"
        return "latest_ahead_unhashed" if _only_sha256_wrong(ckpts, latest) else f"wrong_latest ({latest})"
    if restored is None:
        return "silent_restart"
    manifest, payload = restored
    if payload != payload_for(manifest.step) or (expected is not None and manifest.step < expected):
        return "wrong_restore"
    latest = ckpts.latest_step()
    if latest != manifest.step:
        if latest > manifest.step and _only_sha256_wrong(ckpts, latest):
            return "latest_ahead_unhashed"
        return f"wrong_latest ({latest})"
    if expected is None or manifest.step > expected:
        return "harmless_damage_accepted"  # e.g. a removed "meta" re-checksummed: the same state, same step
    return "fell_back" if expected != newest else "correct"


def _only_sha256_wrong(ckpts: CheckpointStore, step: int) -> bool:
    """Whether the checkpoint ``latest_step`` named at ``step`` fails only its payload sha256 (which
    ``latest_step`` does not re-hash, by design)."""
    return any(s.step == step and s.manifest is not None and "sha256 mismatch" in (s.problem or "")
               for s in ckpts.inspect(verify_payloads=True))
