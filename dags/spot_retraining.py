"""spot_retraining: weekly retraining on spot, warm-started from the last promoted model, gated on evaluation.

    find_warm_start >> train (SpotTraining) >> evaluate (gate) >> promote

* ``find_warm_start`` reads the registry (``promoted.json``) for the job root of the last promoted model;
  the new job warm-starts its model weights from that job's newest checkpoint (``SPOT_WARM_START_URI``).
  The first run has nothing to start from and trains from scratch.
* ``evaluate`` loads this run's final checkpoint and measures the loss on held-out data; it
  short-circuits (skips ``promote``) unless the model is at least as good as the promoted one.
* ``promote`` records this run's job root and score in the registry.

Files live under ``$AIRFLOW_SPOT_DEMO_DIR/retraining`` (default ``$AIRFLOW_HOME/spot-demo/retraining``).
"""
from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import DAG, get_current_context, task

from airflow_spot.demo import demo_root
from airflow_spot.operators.training import SpotTraining
from airflow_spot.policy.offers import GpuRequest

ROOT = demo_root() / "retraining"
REGISTRY = ROOT / "promoted.json"
TOTAL_STEPS = 300
JOB_URI = f"file://{ROOT}/jobs/{{{{ run_id }}}}"

def held_out_loss(job_uri: str, seed: int = 0, hidden: int = 64, samples: int = 256) -> float:
    """MSE of the job's newest checkpointed model on fresh samples of train_tiny's task."""
    import torch

    from airflow_spot.examples.train_tiny import build
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.storage.object_store import open_store

    _, _, model, _ = build(seed, hidden)
    restored = CheckpointStore(open_store(job_uri).child("checkpoints")).restore_latest(
        lambda path: torch.load(path, map_location="cpu", weights_only=False)
    )
    if restored is None:
        raise FileNotFoundError(f"no checkpoint under {job_uri} to evaluate")
    model.load_state_dict(restored[1]["objects"]["model"])
    model.eval()
    g = torch.Generator().manual_seed(seed)
    torch.randn(512, 16, generator=g)  # the training inputs come first in build(): skip them
    true_w = torch.randn(16, 1, generator=g)
    x = torch.randn(samples, 16, generator=torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), torch.sin(x @ true_w)))


with DAG(
    "spot_retraining",
    schedule="@weekly",
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,  # each run starts from the model the previous one promoted
    tags=["airflow-spot", "retraining"],
    doc_md=__doc__,
) as dag:

    @task
    def find_warm_start() -> str:
        """Job root of the last promoted model, or "" for a cold start."""
        if not REGISTRY.exists():
            return ""
        return json.loads(REGISTRY.read_text())["job_uri"]

    warm = find_warm_start()

    train = SpotTraining(
        task_id="train",
        command=[sys.executable, "-m", "airflow_spot.examples.train_tiny", "--total-steps", str(TOTAL_STEPS)],
        total_steps=TOTAL_STEPS,
        steps_per_segment=100,
        gpus=GpuRequest(count=1, min_memory_gib=16),
        checkpoint_uri=JOB_URI,
        warm_start_uri="{{ ti.xcom_pull(task_ids='find_warm_start') }}",
        backend="local",
        backend_options={"state_dir": str(ROOT / "instances")},
        deadline=timedelta(hours=6),
        max_preemptions=10,
        retries=1,
        retry_delay=timedelta(seconds=5),
        # with an s3:// checkpoint_uri, an attempt outside the bucket's region is charged its restore and its
        # saves written back across regions (here the local file:// store has no region: nothing is priced)
        segment_options={"poll_interval": 1.0, "checkpoint_region": "auto", "transfer_dollars_per_gib": 0.02},
    )

    @task.short_circuit
    def evaluate(job_uri: str) -> bool:
        """Held-out loss of this run's final model; promote only if it is no worse than the promoted one."""
        loss = held_out_loss(job_uri)
        best = json.loads(REGISTRY.read_text())["loss"] if REGISTRY.exists() else float("inf")
        print(f"held-out loss {loss:.6f}; promoted model {best:.6f}")
        get_current_context()["ti"].xcom_push(key="candidate", value={"job_uri": job_uri, "loss": loss})
        return loss <= best

    @task
    def promote() -> dict:
        candidate = get_current_context()["ti"].xcom_pull(task_ids="evaluate", key="candidate")
        Path(ROOT).mkdir(parents=True, exist_ok=True)
        tmp = REGISTRY.with_suffix(".tmp")
        tmp.write_text(json.dumps(candidate))
        tmp.replace(REGISTRY)  # a reader never sees half a registry
        return candidate

    gate = evaluate(JOB_URI)
    warm >> train >> gate >> promote()
