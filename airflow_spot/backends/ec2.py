"""The ``ec2`` backend: one instance per offer, launched with ``RunInstances`` (spot market options for
spot offers), described in batches, terminated by id, found again by its tags (the describe/list side and
the tags it reads are :class:`~airflow_spot.backends.ec2_describe.Ec2Describe`, a mixin of the backend).

Clients come from the Airflow layer (``SpotHook`` hands down the Amazon provider's ``EC2Hook`` clients,
see :class:`~airflow_spot.backends.base.Clients`); without them (``airflow-spot`` run outside Airflow with
plain AWS credentials) boto3's default chain is used. Either way botocore's ``adaptive`` retry mode
absorbs throttling: no retry loop is written here; what is left after its retries is a transient
:class:`~airflow_spot.backends.base.LaunchError` (:mod:`~airflow_spot.backends.ec2_errors` sorts the errors).

``stopping``/``stopped`` instances serve nothing, so ``describe`` reports them terminated (never warm, never
reused), but EC2 bills their volumes: ``terminate`` and ``reap`` (:meth:`Ec2Backend.stopped_instances`) end them.

Termination reasons from ``describe``: ``Server.SpotInstanceTermination`` -> ``preempted``;
``Client.UserInitiatedShutdown`` -> ``user``; ``Client.InstanceInitiatedShutdown`` (the agent powered
the instance off after its idle timeout) -> ``idle``; anything else -> ``failed``.

Example::

    get_backend("ec2", regions=["us-east-1"], image_id="ami-0123", instance_profile="spot-training",
                subnet_ids={"us-east-1a": "subnet-1"}, security_group_ids=["sg-1"])
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from airflow_spot.backends.base import (
    Backend,
    Clients,
    InstanceInfo,
    LaunchError,
    LaunchSpec,
    TAG_DEPLOYMENT,
    deployment_id,
    launch_token,
)
from airflow_spot.backends.bootstrap import DEFAULT_IMDS_URL, user_data_script
from airflow_spot.backends.ec2_describe import (
    Ec2Describe,
    TAG_JOB,
    TAG_MANAGED,
    TAG_OFFER,
    _STOPPED,
    _TAG_VALUE_MAX,
    encode_offer,
)
from airflow_spot.backends.ec2_describe import MAX_FILTER_VALUES, decode_offer  # noqa: F401 - re-exported
from airflow_spot.backends.ec2_errors import TOKEN_SPENT_CODE, error_code, launch_error, may_have_taken_effect
from airflow_spot.market.aws_regions import validate_regions
from airflow_spot.policy.offers import Market, Offer

log = logging.getLogger(__name__)

#: the launch's idempotency token, so a repeated launch finds its instance even where ClientToken is not
#: honoured (moto ignores it) or the first call's reply was lost
TAG_TOKEN = "airflow-spot:token"

#: EC2 states with nothing left to terminate
_GONE = frozenset({"shutting-down", "terminated"})
_LIVE = frozenset({"pending", "running"})
#: how many fresh instances one launch token may derive after the ones launched under it ended
MAX_RELAUNCHES = 5


def default_clients() -> Clients:
    """boto3's default credential chain with adaptive retries (outside Airflow, e.g. ``airflow-spot reap``)."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "adaptive", "max_attempts": 10})
    return Clients(ec2=lambda region: boto3.client("ec2", region_name=region, config=config), describe="boto3")


def derived_token(token: str, generation: int) -> str:
    """The ClientToken of the ``generation``-th fresh launch for ``token`` after the earlier ones ended
    (generation 0 is ``token`` itself). EC2 answers a token with its instance for at least 24 h after that
    instance terminated, so a new instance needs a new token; deriving it keeps the launch idempotent."""
    return token if generation == 0 else launch_token(token, "relaunch", generation)


def _state(inst: dict) -> str:
    return inst.get("State", {}).get("Name", "pending")


class Ec2Backend(Ec2Describe, Backend):
    """Spot and on-demand EC2 instances running the agent.

    :param regions: regions whose instances this backend describes and lists (launches go to the offer's
        region, which must be one of them).
    :param image_id: AMI with python and the ``training`` extra installed (or give ``launch_template``).
    :param launch_template: ``{"LaunchTemplateName": ..., "Version": ...}`` or with ``LaunchTemplateId``.
    :param subnet_ids: ``{zone: subnet id}``, or a list (then EC2 picks placement from the subnet).
    :param security_group_ids: security groups (no inbound rule is needed: the store is the only channel).
    :param instance_profile: instance profile name or ARN granting the job's store access.
    :param block_device_gib: root volume size; ``root_device_name`` its device (the image's root device).
    :param python: interpreter on the image that runs the agent; ``setup`` shell lines run before it.
    :param imds_url: instance metadata endpoint (a test data plane serves one on 127.0.0.1).
    :param term_grace_seconds: seconds the training command gets after SIGTERM (inside the 2-minute notice).
    :param clients: handed down by the Airflow layer; see :class:`~airflow_spot.backends.base.Clients`.
    """

    #: AWS's two-minute spot interruption notice
    notice_window_seconds = 120.0

    name = "ec2"
    notice_source = "imds"
    uses_clients = True
    reaps_by_run_state = True

    @staticmethod
    def _check_values(regions, image_id, launch_template, block_device_gib, term_grace_seconds) -> list[str]:
        """The checks of the options' values that need no client; the regions as a list."""
        checked = validate_regions([regions] if isinstance(regions, str) else list(regions))
        if image_id is not None and not (isinstance(image_id, str) and image_id.startswith("ami-")):
            raise ValueError(f"ec2 backend: image_id must be an AMI id like 'ami-0123abcd', got {image_id!r}")
        if launch_template is not None and not (
            isinstance(launch_template, dict) and {"LaunchTemplateId", "LaunchTemplateName"} & set(launch_template)
        ):
            raise ValueError("ec2 backend: launch_template must be a dict with LaunchTemplateId or LaunchTemplateName "
                             f"(and optionally Version), got {launch_template!r}")
        if block_device_gib is not None and (
                isinstance(block_device_gib, bool) or not isinstance(block_device_gib, int) or block_device_gib < 8):
            raise ValueError(f"ec2 backend: block_device_gib must be an integer >= 8, got {block_device_gib!r}")
        if isinstance(term_grace_seconds, bool) or not isinstance(term_grace_seconds, (int, float)) \
                or not 0 < term_grace_seconds < float("inf"):
            raise ValueError(f"ec2 backend: term_grace_seconds must be a number of seconds > 0, got "
                             f"{term_grace_seconds!r}")
        return checked

    @classmethod
    def options_problem(cls, options: dict) -> str | None:
        # the checks __init__ makes of the values, without building any client
        try:
            cls._check_values(options.get("regions", ("us-east-1",)), options.get("image_id"),
                              options.get("launch_template"), options.get("block_device_gib"),
                              options.get("term_grace_seconds", 100.0))
        except (ValueError, TypeError) as exc:
            return str(exc)
        return None

    def __init__(
        self,
        regions: list[str] | tuple[str, ...] | str = ("us-east-1",),
        image_id: str | None = None,
        launch_template: dict[str, str] | None = None,
        subnet_ids: dict[str, str] | list[str] | None = None,
        security_group_ids: list[str] | tuple[str, ...] = (),
        instance_profile: str | None = None,
        block_device_gib: int | None = None,
        root_device_name: str = "/dev/sda1",
        python: str = "python3",
        setup: list[str] | tuple[str, ...] = (),
        imds_url: str = DEFAULT_IMDS_URL,
        term_grace_seconds: float = 100.0,
        clients: Clients | None = None,
    ) -> None:
        self.regions = self._check_values(regions, image_id, launch_template, block_device_gib, term_grace_seconds)
        self.image_id = image_id
        self.launch_template = dict(launch_template) if launch_template else None
        self.subnet_ids: dict[str, str] | list[str] = (
            dict(subnet_ids) if isinstance(subnet_ids, dict) else list(subnet_ids or [])
        )
        self.security_group_ids = list(security_group_ids)
        self.instance_profile = instance_profile
        self.block_device_gib = block_device_gib
        self.root_device_name = root_device_name
        self.python = python
        self.setup = list(setup)
        self.imds_url = imds_url
        self.term_grace_seconds = float(term_grace_seconds)
        self.clients = clients or default_clients()
        #: stamped on every launch, so ``reap`` tells this deployment's instances from others' in the account
        self.deployment = deployment_id()
        self._sync: dict[str, Any] = {}
        self._subnet_zone_cache: dict[str, dict[str, str]] = {}

    def serialize(self) -> dict:
        return {
            "regions": list(self.regions), "image_id": self.image_id, "launch_template": self.launch_template,
            "subnet_ids": self.subnet_ids, "security_group_ids": self.security_group_ids,
            "instance_profile": self.instance_profile, "block_device_gib": self.block_device_gib,
            "root_device_name": self.root_device_name, "python": self.python, "setup": self.setup,
            "imds_url": self.imds_url, "term_grace_seconds": self.term_grace_seconds,
        }

    def search_scope(self) -> str:
        return (f"regions {', '.join(self.regions)} (backend_options regions; "
                f"--backend-options '{{\"regions\": [...]}}' for others)")

    def describe_scope(self) -> str:
        """Backends with the same clients and regions describe the same instances (one shared poller)."""
        return f"{self.clients.describe}|{','.join(self.regions)}"

    def client(self, region: str):
        if region not in self._sync:
            if self.clients.ec2 is None:
                raise LaunchError("ec2 backend: no EC2 client factory was handed down", capacity=False)
            try:
                self._sync[region] = self.clients.ec2(region)
            except ValueError as exc:  # e.g. the AWS connection does not exist
                raise LaunchError(f"ec2 backend: {exc}", capacity=False) from exc
        return self._sync[region]

    # ------------------------------------------------------------------ launch
    def launch_parameters(self, spec: LaunchSpec) -> dict[str, Any]:
        """The ``RunInstances`` parameters for ``spec`` (spec fields win over the backend's defaults)."""
        offer = spec.offer
        if offer.region not in self.regions:
            raise LaunchError(f"ec2 backend: offer region {offer.region!r} is not one of the backend's regions "
                              f"{list(self.regions)}; add it to backend_options['regions']", capacity=False)
        if not spec.idempotency_token or len(spec.idempotency_token) > 64:
            raise LaunchError("ec2 backend: idempotency_token must be 1-64 characters (EC2 ClientToken); "
                              "build it with airflow_spot.backends.base.launch_token", capacity=False)
        image_id = spec.image_id or self.image_id
        template = spec.launch_template or self.launch_template
        if not image_id and not template:
            raise LaunchError("ec2 backend: no machine image; set backend_options image_id='ami-...' or "
                              "launch_template={'LaunchTemplateName': ...}", capacity=False)
        try:
            user_data = spec.user_data or user_data_script(
                spec, python=self.python, imds_url=self.imds_url, setup=self.setup,
                options={"term-grace": self.term_grace_seconds},
            )
        except ValueError as exc:
            raise LaunchError(f"ec2 backend: {exc}", capacity=False) from exc
        if len(spec.job_uri) > _TAG_VALUE_MAX:  # reap and the billing read the job back from this tag
            raise LaunchError(f"ec2 backend: the job's root {spec.job_uri!r} is {len(spec.job_uri)} characters; an EC2 "
                              f"tag value holds {_TAG_VALUE_MAX}, and the instance names its job in one: shorten "
                              "checkpoint_uri (e.g. a shorter prefix or DAG id)", capacity=False)
        tags = {**spec.tags, TAG_MANAGED: "true", TAG_JOB: spec.job_uri, TAG_DEPLOYMENT: self.deployment,
                TAG_OFFER: encode_offer(offer), TAG_TOKEN: spec.idempotency_token}
        tag_list = [{"Key": k, "Value": str(v)[:_TAG_VALUE_MAX]} for k, v in tags.items()]
        params: dict[str, Any] = {
            "InstanceType": offer.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": spec.idempotency_token,
            "UserData": user_data,
            # the agent powers the instance off when it goes idle: that must end the bill
            "InstanceInitiatedShutdownBehavior": "terminate",
            # IMDSv2 only (session tokens, what the agent uses); hop limit 2 so a container on the host reaches it
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2},
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tag_list},
                                  {"ResourceType": "volume", "Tags": tag_list}],
        }
        if image_id:
            params["ImageId"] = image_id
        if template:
            params["LaunchTemplate"] = dict(template)
        if offer.is_spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
            if spec.max_price_per_hour is not None:
                # the cap holds while it runs too: EC2 interrupts it (2 min notice) if the price passes it
                params["InstanceMarketOptions"]["SpotOptions"]["MaxPrice"] = f"{spec.max_price_per_hour:.6f}"
        zone = offer.zone if offer.zone.startswith(offer.region) and offer.zone != offer.region else None
        subnet = self._subnet(spec, zone)
        if subnet:
            params["SubnetId"] = subnet
        elif zone:
            params["Placement"] = {"AvailabilityZone": zone}
        groups = list(spec.security_group_ids) or self.security_group_ids
        if groups:
            params["SecurityGroupIds"] = groups
        profile = spec.instance_profile or self.instance_profile
        if profile:
            params["IamInstanceProfile"] = {"Arn": profile} if profile.startswith("arn:") else {"Name": profile}
        size = spec.block_device_gib or self.block_device_gib
        if size:
            params["BlockDeviceMappings"] = [{"DeviceName": self.root_device_name,
                                              "Ebs": {"VolumeSize": int(size), "DeleteOnTermination": True}}]
        return params

    def _subnet(self, spec: LaunchSpec, zone: str | None) -> str | None:
        """The configured subnet in the offer's zone: an instance runs in its subnet's zone, so another
        zone's subnet would launch the offer somewhere the market did not price or rank."""
        if spec.subnet_ids:
            return spec.subnet_ids[0]
        if not self.subnet_ids:
            return None
        if isinstance(self.subnet_ids, dict):
            found = self.subnet_ids.get(zone or "") or None
        else:
            zones = self._subnet_zones(spec.offer.region)
            found = next((s for s in self.subnet_ids if zone is not None and zones.get(s) == zone), None)
        if found is None:
            raise LaunchError(
                f"ec2 backend: no subnet of backend_options subnet_ids {self.subnet_ids} is in {zone or spec.offer.zone}, "
                "where this offer is; add one there (subnet_ids as {zone: subnet} names each), or keep the job's "
                "gpus zones to those of the subnets", capacity=False, unusable=True, tried=[spec.offer.pool])
        return found

    def _subnet_zones(self, region: str) -> dict[str, str]:
        """``{subnet id: zone}`` of the configured subnets of ``region`` (one ``DescribeSubnets``, kept)."""
        if region not in self._subnet_zone_cache:
            from botocore.exceptions import ClientError

            try:
                found = self.client(region).describe_subnets(
                    Filters=[{"Name": "subnet-id", "Values": list(self.subnet_ids)}])["Subnets"]
            except ClientError as exc:
                raise LaunchError(f"ec2 backend: cannot read the zones of subnet_ids {self.subnet_ids} in {region} "
                                  f"({exc}); attach the policy in airflow_spot/backends/iam_policy.json "
                                  "(ec2:DescribeSubnets), or give subnet_ids as {zone: subnet}", capacity=False) from exc
            self._subnet_zone_cache[region] = {s["SubnetId"]: s["AvailabilityZone"] for s in found}
        return self._subnet_zone_cache[region]

    def launch(self, spec: LaunchSpec) -> InstanceInfo:
        """Start one instance for ``spec``, or return the live one its token (ClientToken and a tag: moto
        ignores ClientToken) launched before. One that ended, or is stopped (then it is terminated here), does
        not serve: EC2 keeps answering the token with it, so a fresh one is launched under the next
        :func:`derived_token`, which a repeated call finds in turn. A ``RunInstances`` that got no reply or a 5xx
        may have launched anyway: the instance is looked up by its token before the transient error is raised
        (EC2's describe can lag a launch: then a later launch with the same token finds it)."""
        from botocore.exceptions import BotoCoreError, ClientError

        self.launch_parameters(spec)  # configuration errors before any call
        offer, region = spec.offer, spec.offer.region
        tokens = [derived_token(spec.idempotency_token, g) for g in range(MAX_RELAUNCHES + 1)]
        try:
            found = self._by_token(tokens, region)
        except (ClientError, BotoCoreError) as exc:
            raise launch_error(exc, offer, "DescribeInstances") from exc
        self._terminate_stopped([i for i in found.values() if _state(i) in _STOPPED], region)
        for generation in reversed(range(len(tokens))):
            inst = found.get(tokens[generation])
            if inst is not None and _state(inst) in _LIVE:
                info = self._info(inst, region)
                log.info("launch token %s already launched %s", tokens[generation], info.instance_id)
                return info
        used = [g for g, t in enumerate(tokens) if t in found]
        generation = max(used) + 1 if used else 0
        ended = [found[tokens[g]]["InstanceId"] for g in used]
        while generation < len(tokens):
            token = tokens[generation]
            params = self.launch_parameters(dataclasses.replace(spec, idempotency_token=token))
            try:
                reply = self.client(region).run_instances(**params)
            except (ClientError, BotoCoreError) as exc:
                if error_code(exc) == TOKEN_SPENT_CODE:  # its instance ended and left describe already
                    ended.append(f"{TOKEN_SPENT_CODE} for token {token[:12]}...")
                    generation += 1
                    continue
                if may_have_taken_effect(exc):
                    return self._launched_despite(exc, token, offer)
                raise launch_error(exc, offer) from exc
            instances = reply.get("Instances") or []
            if not instances:
                raise LaunchError(f"RunInstances returned no instance for {offer.pool}", capacity=True,
                                  tried=[offer.pool])
            if _state(instances[0]) not in _LIVE:  # EC2 answered the token with its instance, which ended
                self._terminate_stopped([instances[0]] if _state(instances[0]) in _STOPPED else [], region)
                ended.append(instances[0]["InstanceId"])
                generation += 1
                continue
            info = self._info(instances[0], region)
            if generation:
                log.info("the instances launched before under token %s ended (%s): launched a fresh one",
                         spec.idempotency_token, ", ".join(ended))
            log.info("launched %s: %s %s in %s at $%.4f/h (token %s)", info.instance_id, offer.instance_type,
                     Market(offer.market).value, offer.zone, offer.price_per_hour, token)
            return info
        raise LaunchError(
            f"ec2 backend: the {len(ended)} instances launched for this launch token in {offer.pool} all ended "
            f"({', '.join(ended)}); not launching another in this pool under the same token: try the next "
            "offer (a new Airflow try launches under a new token)", capacity=True, tried=[offer.pool],
        )

    def _launched_despite(self, exc: Exception, token: str, offer: Offer) -> InstanceInfo:
        """After a ``RunInstances`` that may have launched anyway: the live instance under ``token``, or the
        transient :class:`LaunchError` for ``exc``."""
        from botocore.exceptions import BotoCoreError, ClientError

        error = launch_error(exc, offer)
        try:
            inst = self._by_token([token], offer.region).get(token)
        except (ClientError, BotoCoreError) as lookup:
            log.warning("RunInstances for %s failed (%s) and the lookup of token %s failed too (%s)", offer.pool,
                        exc, token, lookup)
            raise error from exc
        if inst is None or _state(inst) not in _LIVE:
            raise error from exc
        info = self._info(inst, offer.region)
        log.warning("RunInstances for %s failed (%s), but it had launched %s (token %s): using it", offer.pool,
                    exc, info.instance_id, token)
        return info

    def _by_token(self, tokens: list[str], region: str) -> dict[str, dict]:
        """``{token: instance}`` of the instances tagged with these launch tokens (one describe), a live one
        before a stopped one before one that is gone where a token has several (moto ignores ClientToken)."""
        rank = {**{s: 0 for s in _LIVE}, **{s: 1 for s in _STOPPED}}
        out: dict[str, dict] = {}
        filters = [{"Name": f"tag:{TAG_TOKEN}", "Values": list(tokens)}]
        for page in self.client(region).get_paginator("describe_instances").paginate(Filters=filters):
            for reservation in page.get("Reservations", []):
                for inst in reservation.get("Instances", []):
                    token = next((t["Value"] for t in inst.get("Tags", []) if t["Key"] == TAG_TOKEN), "")
                    best = out.get(token)
                    if best is None or rank.get(_state(inst), 2) < rank.get(_state(best), 2):
                        out[token] = inst
        return out

    def _terminate_stopped(self, instances: list[dict], region: str) -> None:
        """Terminate stopped instances a launch token found: they serve nothing and their volumes are billed."""
        from botocore.exceptions import BotoCoreError, ClientError

        ids = [i["InstanceId"] for i in instances]
        if not ids:
            return
        try:
            self.client(region).terminate_instances(InstanceIds=ids)
        except (ClientError, BotoCoreError) as exc:
            log.warning("could not terminate the stopped instances %s (%s); `airflow-spot reap` will", ids, exc)
            return
        log.info("terminated %s: stopped, they serve nothing and their volumes are billed", ", ".join(ids))

    # ------------------------------------------------------------------ terminate
    def terminate(self, instance_ids: list[str]) -> None:
        """Terminate in one call per region; ids unknown or already gone are skipped (idempotent). Stopped
        instances are terminated too: ``describe`` calls them terminated, but their volumes are still billed."""
        ids = list(dict.fromkeys(instance_ids))
        if not ids:
            return
        from botocore.exceptions import ClientError

        # a region that does not answer (not opted in, a policy, an outage) must not keep the others' instances
        # running: each region is asked on its own, and the failures are raised at the end, by region
        failed: dict[str, BaseException] = {}
        described = self._describe_raw(ids, failed)
        by_region: dict[str, list[str]] = {}
        for instance_id, (region, inst) in described.items():
            if _state(inst) not in _GONE:
                by_region.setdefault(region, []).append(instance_id)
        for region, region_ids in by_region.items():
            try:
                self.client(region).terminate_instances(InstanceIds=region_ids)
            except Exception as exc:  # noqa: BLE001 - the other regions' instances still go
                failed.setdefault(region, exc)
                continue
            log.info("terminated %s in %s", ", ".join(region_ids), region)
        # Not described yet is not gone: right after RunInstances, EC2's describe may lag (eventual
        # consistency), and an on_kill then must still stop the instance. Ask each region; "not found" is fine.
        for instance_id in (i for i in ids if i not in described):
            for region in self.regions:
                try:
                    self.client(region).terminate_instances(InstanceIds=[instance_id])
                except ClientError as exc:
                    if not str(exc.response.get("Error", {}).get("Code", "")).startswith("InvalidInstanceID"):
                        failed.setdefault(region, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - as above
                    failed.setdefault(region, exc)
                    continue
                log.info("terminated %s in %s (not yet visible to describe)", instance_id, region)
                break
        if failed:
            raise LaunchError("ec2 backend: could not end instances in " + "; ".join(
                f"{region} ({type(exc).__name__}: {exc})" for region, exc in failed.items())
                + f"; the instances of {sorted(set(self.regions) - set(failed))} were ended", capacity=False)
