"""README claims checked against the code (a review as a new user who trusts the README).

Each test quotes the README (or a public docstring) it checks. The failing ones are places where the
code does not do what the README promises and the promise is the sensible behaviour; the passing ones pin
claims that held when reviewed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from airflow_spot.policy.offers import GpuRequest, Market

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- failing
def test_zones_on_the_local_catalog_keep_the_regions_on_demand_offers():
    """README, "GpuRequest filters": "``zones`` (as the job's market names them: ids such as ``use1-az1`` on
    the ``local`` backend's catalog, ...; on-demand offers are regional and pass when their region has an
    allowed zone)".

    On the local catalog a zone is an id (``use1-az1``) and an on-demand offer's zone is its region
    (``us-east-1``); ``GpuRequest._zone_allowed`` lets an on-demand offer through only when an allowed zone
    *starts with* the region's name, which a zone id never does. So every on-demand offer is dropped, and a
    job with a deadline and ``zones`` has no on-demand fallback at all."""
    from airflow_spot.market.catalog import CatalogMarket

    request = GpuRequest(count=1, zones=("use1-az1",))
    offers = CatalogMarket().offers(request)
    assert any(o.market is Market.SPOT and o.zone == "use1-az1" for o in offers)  # the spot side works
    on_demand = [o for o in offers if Market(o.market) is Market.ON_DEMAND]
    assert on_demand, "no on-demand offer passes zones=('use1-az1',), though use1-az1 is a zone of us-east-1"
    assert {o.region for o in on_demand} == {"us-east-1"}


def test_offers_command_with_local_zone_ids_lists_on_demand_offers_of_that_region():
    """The same, as a user meets it: ``airflow-spot offers --zones use1-az1`` (the README's ``--zones`` "as the
    market names them (ids such as ``use1-az1`` on ``local``...)") lists only spot offers; without
    ``--spot-only`` the on-demand offers of us-east-1 should be there too."""
    out = subprocess.run([sys.executable, "-m", "airflow_spot.cli", "offers", "--gpus", "1", "--zones", "use1-az1",
                          "--limit", "2000"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:] if not line.startswith("...")]
    assert any(r[2] == "spot" for r in rows)
    assert any(r[2] == "on-demand" and r[1] == "us-east-1" for r in rows), out.stdout[-2000:]


def test_an_s3_store_on_a_connection_that_does_not_exist_is_an_error_not_the_machines_credentials(monkeypatch):
    """README, "The EC2 backend" / "Connection": "A connection that does not exist is an error naming it and how
    to create it (no silent fall-back to the machine's credentials). The same connection's ``S3Hook`` serves
    an ``s3://`` store."

    ``SpotHook.ec2_hook`` checks the connection (``_check_connection``), but ``SpotHook.get_store`` hands the
    id straight to the Amazon provider's ``S3Hook``, which logs "Unable to find AWS Connection ID ..., switching
    to empty" and falls back to boto3's default chain: a mistyped ``aws_conn_id`` on an ``s3://`` job writes
    its checkpoints with whatever credentials the worker happens to have."""
    from airflow_spot.hooks.spot import SpotHook

    conn_id = "readme_review_no_such_connection"
    monkeypatch.delenv(f"AIRFLOW_CONN_{conn_id.upper()}", raising=False)
    hook = SpotHook(backend="local", aws_conn_id=conn_id)
    with pytest.raises(ValueError, match=conn_id):
        hook.get_store("s3://some-bucket/dag/run")


def test_the_session_is_told_the_local_backends_notice_window_not_awss(tmp_path):
    """README, "The training script": the checkpoint interval counts on the notice, and ``q`` "is 0 when the
    measured save (staging plus write) does not fit the notice window"; "Where things run": the ``local``
    backend's injector sends "the notice, waiting the notice window, then killing the process group"
    (``backend_options["notice_window_seconds"]``, 5 s by default).

    The window the training session judges its saves against is the segment's own
    ``notice_window_seconds`` option (``SegmentRequest.notice_window_seconds`` -> ``SPOT_NOTICE_WINDOW_SECONDS``),
    which defaults to AWS's 120 s whatever the backend: on the local backend a session whose emergency save
    takes 30 s believes it fits, keeps ``q`` at 0.99 and stretches its periodic saves ten-fold, and every
    preemption then kills the save at 5 s and loses up to the whole interval. (The demo hides it by setting
    the same figure twice, in ``segment_options`` and ``backend_options``.)"""
    from types import SimpleNamespace

    from airflow.sdk import DAG

    from airflow_spot.operators import SpotTraining

    with DAG("readme_review_notice_window", schedule=None) as dag:
        SpotTraining(task_id="train", command=[sys.executable, "-c", "pass"], total_steps=10, steps_per_segment=10,
                     checkpoint_uri=f"file://{tmp_path}/job",
                     backend_options={"state_dir": str(tmp_path / "instances"), "notice_window_seconds": 5.0})
    segment = dag.task_dict["train.segment_000"]
    request = segment._request("train.segment_000.try1", 0.0, SimpleNamespace(mtbf_seconds=None))
    assert request.notice_window_seconds == 5.0, (
        f"the local backend kills 5 s after its notice, but the session is told {request.notice_window_seconds} s")


# ----------------------------------------------------------------------------------------------- passing
def test_the_readme_job_snippets_parse_and_build_what_the_text_says():
    """README, "Declaring a job" and "The EC2 backend": both snippets parse; the group is
    ``train.segment_000 >> ... >> train.finish``, ``finish`` runs ALL_DONE, each segment gets Airflow
    ``retries = max_preemptions + retries`` (SpotTraining's docstring) and defers by default."""
    from airflow.sdk import DAG, TriggerRule

    from airflow_spot.operators import SpotTraining

    with DAG("readme_review_train_resnet", schedule=None) as dag:
        SpotTraining(
            task_id="train",
            command=["python", "train.py"],
            total_steps=20_000, steps_per_segment=2_000,
            gpus=GpuRequest(count=1, min_memory_gib=16),
            checkpoint_uri="s3://bucket/{{ dag.dag_id }}/{{ run_id }}",
            backend="local",
            deadline=timedelta(hours=10),
            max_preemptions=15, retries=2,
        )
    ids = sorted(dag.task_dict)
    assert ids == ["train.finish"] + [f"train.segment_{i:03d}" for i in range(10)]
    first = dag.task_dict["train.segment_000"]
    assert first.retries == 17 and first.code_retries == 2 and first.max_preemptions == 15
    assert dag.task_dict["train.finish"].trigger_rule == TriggerRule.ALL_DONE
    assert dag.task_dict["train.segment_001"].upstream_task_ids == {"train.segment_000"}
    assert dag.task_dict["train.finish"].upstream_task_ids == {"train.segment_009"}
    if "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE" not in os.environ:
        assert first.deferrable is True

    with DAG("readme_review_ec2", schedule=None) as dag2:
        SpotTraining(
            task_id="train", command=["python3", "/opt/project/train.py"],
            total_steps=200_000, steps_per_segment=10_000,
            gpus=GpuRequest(count=1, min_memory_gib=24, names=("A10G", "L4", "L40S"), max_price_per_hour=1.5,
                            zones=("us-east-1a", "us-east-1b")),
            checkpoint_uri="s3://my-bucket/{{ dag.dag_id }}/{{ run_id }}",
            backend="ec2",
            backend_options={"regions": ["us-east-1"], "image_id": "ami-0123abcd", "instance_profile": "spot-training",
                             "subnet_ids": {"us-east-1a": "subnet-aaa", "us-east-1b": "subnet-bbb"},
                             "security_group_ids": ["sg-123"], "block_device_gib": 200},
            market_options={"regions": ["us-east-1"]},
            aws_conn_id="aws_default",
        )
    assert len(dag2.task_dict) == 21


@pytest.mark.parametrize("change, fragment", [
    ({"total_steps": 0}, "total_steps"),
    ({"steps_per_segment": 200}, "larger than total_steps"),
    ({"backend": "gce"}, "unknown backend"),
    ({"checkpoint_uri": "gs://b/x"}, "unsupported scheme"),
    ({"gpus": GpuRequest(count=64)}, "no instance type offers 64"),
    ({"command": ["readme-review-no-such-program", "x"]}, "not found on PATH"),
    ({"segment_options": {"poll_intervall": 1}}, "unknown segment_options"),
    ({"backend_options": {"foo": 1}}, "backend_options: unknown keys"),
    ({"market_options": {"foo": 1}}, "market_options: unknown keys"),
    ({"gpus": {"cnt": 1}}, "gpus: unknown keys"),
    ({"backend_options": {"preemption": {"mode": "schedule", "after_seconds": [-1]}}}, "after_seconds"),
    ({"backend_options": {"notice_window_seconds": -1}}, "notice_window_seconds"),
    ({"segment_options": {"stall_timeout": float("nan")}}, "finite number of seconds > 0"),
    ({"deadline": timedelta(seconds=10), "total_steps": 100_000, "steps_per_segment": 1000,
      "segment_options": {"step_profile": {"T4": 1.0}}}, "cannot be met"),
    ({"gpus": GpuRequest(zones=("us-east-1a",))}, "names zones by id"),
])
def test_what_spottraining_refuses_at_parse_time(tmp_path, change, fragment):
    """README, "Declaring a job": "SpotTraining validates its arguments at parse time (zero steps, a segment
    longer than the job, an unknown backend, a malformed checkpoint URI, a GPU request no instance type in the
    catalog can satisfy, a program that is not on PATH (local backend), an unknown key of ..., a value of
    backend_options the backend refuses (... preemption schedule, its seconds), a seconds option that is not a
    finite number > 0, a deadline the declared step_profile says the work alone outlasts ..."."""
    from airflow.sdk import DAG

    from airflow_spot.operators import SpotTraining
    from airflow_spot.operators.validation import SpotTrainingConfigError

    kwargs = dict(task_id="train", command=[sys.executable, "train.py"], total_steps=100, steps_per_segment=50,
                  checkpoint_uri=f"file://{tmp_path}/job")
    kwargs.update(change)
    with pytest.raises(SpotTrainingConfigError, match=fragment):
        with DAG(f"readme_review_refusal_{abs(hash(fragment))}", schedule=None):
            SpotTraining(**kwargs)


def test_a_second_job_on_the_same_checkpoint_uri_is_refused(tmp_path):
    from airflow.sdk import DAG

    from airflow_spot.operators import SpotTraining
    from airflow_spot.operators.validation import SpotTrainingConfigError

    kwargs = dict(command=[sys.executable, "train.py"], total_steps=10, steps_per_segment=10,
                  checkpoint_uri=f"file://{tmp_path}/job")
    with pytest.raises(SpotTrainingConfigError, match="also the root of job"):
        with DAG("readme_review_same_root", schedule=None):
            SpotTraining(task_id="a", **kwargs)
            SpotTraining(task_id="b", **kwargs)


def test_a_command_string_is_split_as_a_shell_would_with_jinja_kept_whole():
    """README snippet comment: "templated; a string is split as a shell would, {{ ... }} kept whole"."""
    from airflow_spot.operators.validation import normalize_command

    argv = normalize_command("python train.py --date {{ ds }} --name 'a b'", "local")
    assert argv == ["python", "train.py", "--date", "{{ ds }}", "--name", "a b"]


def test_training_package_exports_and_a_script_run_by_hand(tmp_path, monkeypatch):
    """README, "The training script": ``from airflow_spot.training import ResumableSampler, SpotSession``; "Run
    by hand without the agent, the same script trains total_steps with checkpoints in ./spot-job"; "spot.save()
    in the loop's body is taken when the current step is done"; track() before save()/steps() and steps()
    inside the with block are refused with the fix."""
    torch = pytest.importorskip("torch")
    import airflow_spot.training as training
    from airflow_spot.training import ResumableLoader, ResumableSampler, SpotSession  # noqa: F401

    assert set(training.__all__) == {"ResumableLoader", "ResumableSampler", "SpotSession"}
    for name in [k for k in os.environ if k.startswith("SPOT_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with SpotSession.from_env(total_steps=6, heartbeat_seconds=60.0) as spot:
        assert spot.track(model=model, optimizer=opt, sampler=ResumableSampler(10)) == 0
        for step in spot.steps():
            loss = model(torch.ones(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 2:
                spot.save()
    assert spot.job_store.uri == f"file://{tmp_path}/spot-job"
    assert [m.step for m in spot.checkpoints.committed()] == [3, 6]

    fresh = SpotSession.from_env(total_steps=6)
    with pytest.raises(RuntimeError, match="before spot.save"):
        fresh.save()
    fresh.track(model=model)
    with pytest.raises(RuntimeError, match="inside `with"):
        next(iter(fresh.steps()))


def test_cli_commands_and_flags_the_readme_names_exist():
    """README, "Commands": each command and the flags its table row and the text name."""
    from airflow_spot.cli import build_parser

    def parses(argv):
        build_parser(argv).parse_args(argv)

    parses(["demo", "--verify", "--mtbf", "5", "--preempt-after", "4,4,4", "--backend", "ec2", "--moto",
            "--log-file", "f", "--verbose"])
    parses(["simulate", "--work-hours", "48", "--deadline-hours", "52", "--policies", "ours,rc-cr,hindsight",
            "--segment-minutes", "15", "--offsets", "--png", "f.png", "--json", "f.json", "--prices", "p.csv",
            "--transfer-seconds", "120", "--transfer-dollars", "1", "--traces", "a", "--nodes", "2", "--jobs", "2",
            "--history-hours", "24", "--probe-miss", "0.18", "--mean-prices", "--spot-price", "0.9731",
            "--on-demand-price", "3.06", "--store-region", "us-east-1", "--checkpoint-gib", "50",
            "--transfer-dollars-per-gib", "0.02", "--restart-overhead-hours", "0.2", "--start-hour", "0"])
    parses(["estimate", "--steps", "20000", "--measured", "V100=0.21", "--top", "2"])
    parses(["estimate", "--steps", "20000", "--profile-command", "python train.py", "--profile-as", "T4"])
    parses(["offers", "--backend", "ec2", "--gpus", "1", "--min-memory-gib", "16", "--regions", "us-east-1",
            "--zones", "us-east-1a", "--gpu-names", "A10G", "--exclude-gpus", "K80", "--max-price", "2",
            "--spot-only", "--market-options", '{"spot_prices": "catalog"}', "--limit", "3"])
    parses(["checkpoints", "list", "--quick", "--verbose", "u"])
    parses(["checkpoints", "verify", "--endpoint-url", "http://x", "u"])
    parses(["checkpoints", "restore", "--step", "5", "--to", "p", "--force", "--dry-run", "u"])
    parses(["reap", "--backend", "ec2", "--dry-run", "--older-than", "60", "--tag", "k=v", "--runs", "any",
            "--purge-older-than", "60"])
    parses(["availability", "show", "--hours", "24", "u"])
    parses(["availability", "compact", "--older-than-hours", "6", "--dry-run", "u"])
    parses(["availability", "prune", "--older-than-days", "14", "--dry-run", "u"])


def test_iam_policy_lists_the_actions_the_readme_names():
    """README, "IAM": DescribeInstanceTypes, DescribeSpotPriceHistory, DescribeInstances, DescribeSubnets,
    RunInstances, CreateTags only at launch, TerminateInstances only on instances tagged airflow-spot:managed,
    iam:PassRole, the bucket's object calls (and s3:GetBucketLocation for checkpoint_region 'auto')."""
    import json

    with open(os.path.join(REPO, "airflow_spot", "backends", "iam_policy.json")) as f:
        policy = json.load(f)
    by_action = {a: s for s in policy["Statement"] for a in s["Action"]}
    ec2 = {a for a in by_action if a.startswith("ec2:")}
    assert ec2 == {"ec2:DescribeInstanceTypes", "ec2:DescribeSpotPriceHistory", "ec2:DescribeInstances",
                   "ec2:DescribeSubnets", "ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances"}
    assert by_action["ec2:CreateTags"]["Condition"] == {"StringEquals": {"ec2:CreateAction": "RunInstances"}}
    assert by_action["ec2:TerminateInstances"]["Condition"] == {
        "StringEquals": {"aws:ResourceTag/airflow-spot:managed": "true"}}
    assert "iam:PassRole" in by_action and "s3:GetBucketLocation" in by_action


def test_ui_routes_answer_401_without_a_token_and_serve_no_docs():
    """README, "The Spot Training UI": every route answers 401 without authentication; no /docs or
    /openapi.json is served."""
    from fastapi.testclient import TestClient

    from airflow_spot.ui.app import app

    client = TestClient(app)
    for path in ("/", "/api/jobs", "/api/jobs/d/r", "/jobs/d/r"):
        assert client.get(path).status_code == 401, path
    for path in ("/docs", "/openapi.json"):
        assert client.get(path).status_code == 404, path


def test_segments_defer_unless_segment_options_or_the_environment_say_otherwise(tmp_path, monkeypatch):
    """README, "Segments defer by default ... only deferrable=False in segment_options, or the deployment's
    environment setting AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE=False, makes it wait in a worker slot"; and a
    retry_policy passed to SpotTraining "is asked first (UserFirstRetryPolicy)"."""
    from airflow.sdk import DAG, ExceptionRetryPolicy, RetryAction, RetryRule

    from airflow_spot.operators import SpotTraining
    from airflow_spot.operators.retry import UserFirstRetryPolicy
    from airflow_spot.operators.segment import SegmentPreempted

    def build(name, **extra):
        with DAG(name, schedule=None) as dag:
            SpotTraining(task_id="train", command=[sys.executable, "t.py"], total_steps=10, steps_per_segment=10,
                         checkpoint_uri=f"file://{tmp_path}/{name}", **extra)
        return dag.task_dict["train.segment_000"]

    monkeypatch.delenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", raising=False)
    assert build("readme_review_defer_a").deferrable is True
    assert build("readme_review_defer_b", segment_options={"deferrable": False}).deferrable is False
    monkeypatch.setenv("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE", "False")
    assert build("readme_review_defer_c").deferrable is False

    user = ExceptionRetryPolicy(rules=[RetryRule(exception=KeyError, action=RetryAction.FAIL)])
    segment = build("readme_review_retry_policy", retry_policy=user)
    assert isinstance(segment.retry_policy, UserFirstRetryPolicy)
    assert segment.retry_policy.evaluate(KeyError("x"), 1, 5).action is RetryAction.FAIL
    decision = segment.retry_policy.evaluate(SegmentPreempted("instance i-1 went; resumes from step 3"), 1, 5)
    assert decision.action is RetryAction.RETRY and decision.retry_delay.total_seconds() == 0


def test_checkpoints_command_and_the_block_digest_as_the_readme_describes_them(tmp_path, capsys):
    """README, "The checkpoint store" / "Reliability": the digest is "the SHA-256 of the blocks' digests in
    order" (8 MiB blocks, named in the manifest); ``checkpoints verify`` exits 1 naming the broken checkpoint and
    the step a resume uses; ``restore --step N --to PATH`` copies, refuses an existing file without ``--force``;
    ``restore --step N`` moves newer checkpoints under ``quarantine/``, deleting nothing."""
    import hashlib
    import json

    from airflow_spot.cli import main
    from airflow_spot.storage.checkpoint import CheckpointStore
    from airflow_spot.storage.object_store import open_store

    ckpts = CheckpointStore(open_store(f"file://{tmp_path}/job").child("checkpoints"), writer="w")
    payload = os.urandom(9 * 1024 * 1024)  # two blocks
    manifests = [ckpts.save(step, lambda f: f.write(payload)) for step in (100, 200, 300)]
    entry = manifests[0].files[0]
    blocks = [payload[i:i + 8 * 1024 * 1024] for i in range(0, len(payload), 8 * 1024 * 1024)]
    assert entry.sha256_block == 8 * 1024 * 1024
    assert entry.sha256 == hashlib.sha256(b"".join(hashlib.sha256(b).digest() for b in blocks)).hexdigest()

    job = str(tmp_path / "job")
    assert main(["checkpoints", "verify", job]) == 0
    manifest_path = tmp_path / "job" / "checkpoints" / manifests[1].directory / "MANIFEST.json"
    edited = json.loads(manifest_path.read_text())
    edited["meta"] = {"edited": True}
    manifest_path.write_text(json.dumps(edited))
    capsys.readouterr()
    assert main(["checkpoints", "verify", job]) == 1
    out = capsys.readouterr().out
    assert f"BROKEN step 200 [{manifests[1].directory}]: manifest checksum does not match" in out
    assert "a resume uses step 300" in out

    target = tmp_path / "copy.pt"
    assert main(["checkpoints", "restore", "--step", "100", "--to", str(target), job]) == 0
    assert target.read_bytes() == payload
    assert main(["checkpoints", "restore", "--step", "100", "--to", str(target), job]) == 2
    assert main(["checkpoints", "restore", "--step", "100", "--to", str(target), "--force", job]) == 0
    assert main(["checkpoints", "restore", "--step", "100", job]) == 0
    assert ckpts.latest_step() == 100
    quarantined = sorted(p.name for p in (tmp_path / "job" / "checkpoints" / "quarantine").iterdir())
    assert quarantined == sorted([manifests[1].directory, manifests[2].directory])
