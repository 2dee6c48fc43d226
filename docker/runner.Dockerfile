# The runner image: what a training instance runs. No Airflow: the agent and the training library only
# (the `training` extra), torch, and the agent as the entrypoint.
#
# Build from the repository root:
#   docker build -f docker/runner.Dockerfile -t airflow-spot-runner:dev .
#
# On EC2 the agent learns its instance id and region from IMDSv2 and its job from the launch's user data;
# run by hand (or by the `local` backend's contract) it takes them as arguments, e.g.
#   docker run --rm airflow-spot-runner:dev --job-uri s3://bucket/job --instance-id i-0123 --idle-timeout 300
# The instance profile gives it S3 access: no credentials go into the image or the user data.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# CPU wheels of torch; a plain `pip install torch` would pull a multi-GB CUDA build. For GPU instances,
# build with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 (or the CUDA of the AMI).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

COPY . /opt/airflow-spot
# The package's core requirements are the Airflow side (apache-airflow, the Amazon provider): install it
# without them (--no-deps) and add exactly the `training` extra of setup.cfg. tests/docker checks that the
# list below stays equal to that extra.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
        "torch>=2.2,<3" "boto3>=1.34" "numpy>=1.24" \
 && pip install --no-cache-dir --no-deps /opt/airflow-spot \
 && python -c "import airflow_spot.training.agent, airflow_spot.training.session" \
 && ! python -c "import airflow" 2>/dev/null

RUN useradd --create-home --uid 50000 spot
USER spot
WORKDIR /home/spot

ENTRYPOINT ["python", "-m", "airflow_spot.training.agent"]
