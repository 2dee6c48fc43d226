"""EC2 errors sorted into "try the next offer" (capacity), "try again soon" (transient) and "fix your
configuration" (with the fix).

Transient errors are those botocore itself retries (throttling, 5xx, no answer on the network) and still got
after its retries ran out: nothing in the configuration is wrong, a later call may well work.
"""
from __future__ import annotations

from airflow_spot.backends.base import LaunchError
from airflow_spot.policy.offers import Offer

#: a pool is full: another pool (or later) may work
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "SpotMaxPriceTooLow", "InsufficientFreeAddressesInSubnet",
})

#: the account's quota is used up: no pool is full, and another market or instance family may still launch
QUOTA_CODES = frozenset({"MaxSpotInstanceCountExceeded", "VcpuLimitExceeded", "InstanceLimitExceeded"})

#: EC2 refused the call for its rate: nothing was done, a later call will work
THROTTLING_CODES = frozenset({
    "RequestLimitExceeded", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "EC2ThrottledException", "TooManyRequestsException", "SlowDown",
    "BandwidthLimitExceeded",
})

#: EC2 failed on its side (usually with a 5xx): the call may or may not have taken effect
SERVER_CODES = frozenset({
    "InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable", "RequestTimeout",
    "RequestTimeoutException", "PriorRequestNotComplete",
})

#: EC2 answers a ClientToken whose instance has terminated with this: a new launch needs a new token
TOKEN_SPENT_CODE = "IdempotentInstanceTerminated"

_HINTS = {
    "InvalidAMIID.Malformed": "the image id is malformed; set backend_options image_id to an AMI id like ami-0123abcd",
    "InvalidAMIID.NotFound": "the image does not exist in this region; AMIs are regional, copy it or pick this "
                             "region's id",
    "InvalidAMIID.Unavailable": "the image is not available; pick another AMI",
    "UnauthorizedOperation": "the AWS identity lacks a permission; attach the policy in "
                             "airflow_spot/backends/iam_policy.json",
    "AccessDenied": "the AWS identity lacks a permission; attach the policy in airflow_spot/backends/iam_policy.json",
    "AuthFailure": "the AWS credentials of the connection are not valid",
    "InvalidParameterValue": "a launch parameter is wrong (instance type, subnet, tags)",
    "InvalidSubnetID.NotFound": "the subnet does not exist in this region; fix backend_options subnet_ids",
    "InvalidGroup.NotFound": "a security group does not exist; fix backend_options security_group_ids",
    "InvalidParameterCombination": "these launch parameters cannot be combined (e.g. a subnet in another zone)",
    "Unsupported": "this instance type is not offered here (try another zone or type)",
    "NoSuchEntity": "the instance profile does not exist; fix backend_options instance_profile",
    "InvalidParameterValue.IamInstanceProfile": "the instance profile does not exist; fix backend_options "
                                                "instance_profile",
    "OptInRequired": "the account is not subscribed to this region or image",
}


#: the identity or account cannot make the call: a retry meets the same refusal
PERMISSION_CODES = frozenset({"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "AuthFailure",
                              "OptInRequired", "InvalidClientTokenId", "UnrecognizedClientException",
                              "SignatureDoesNotMatch"})


def configuration_problem(exc: BaseException) -> str | None:
    """What to fix when ``exc`` (or what it was raised from) is AWS refusing the caller itself (a missing
    permission, bad credentials, a region not opted in): a retry would meet the same refusal. None otherwise."""
    for err in (exc, exc.__cause__):
        code = error_code(err) if err is not None else ""
        if code in PERMISSION_CODES:
            hint = _HINTS.get(code) or _HINTS["UnauthorizedOperation"]
            return f"{exc} ({hint})" if hint not in str(exc) else str(exc)
    return None


def error_code(exc) -> str:
    """The EC2 error code of a botocore ``ClientError`` (``""`` for anything else)."""
    response = getattr(exc, "response", None)
    return str((response or {}).get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _status(exc) -> int:
    response = getattr(exc, "response", None)
    try:
        return int(((response or {}).get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    except (TypeError, ValueError):
        return 0


def is_network_error(exc) -> bool:
    """No answer from EC2: a read or connect timeout, a closed or refused connection (botocore's
    ``HTTPClientError`` and ``ConnectionError``, the ones its retry modes treat as transient)."""
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import HTTPClientError

    return isinstance(exc, (BotoConnectionError, HTTPClientError))


def is_transient(exc) -> bool:
    """Worth trying again soon with nothing changed: throttling, a 5xx (but not a capacity refusal, which EC2
    also sends with a 500), or no answer on the network."""
    if is_network_error(exc):
        return True
    code = error_code(exc)
    if not code or code in CAPACITY_CODES or code in QUOTA_CODES:
        return False
    return code in THROTTLING_CODES or code in SERVER_CODES or _status(exc) >= 500


def may_have_taken_effect(exc) -> bool:
    """A transient error after which EC2 may have done what was asked (no reply, or a failure on its side);
    a throttled call did nothing."""
    return is_transient(exc) and error_code(exc) not in THROTTLING_CODES


def launch_error(exc, offer: Offer, operation: str = "RunInstances") -> LaunchError:
    """A :class:`LaunchError` for a botocore ``ClientError`` or ``BotoCoreError`` raised while launching
    ``offer`` (by ``operation``)."""
    market = getattr(offer.market, "value", offer.market)
    code = error_code(exc)
    if is_network_error(exc):
        return LaunchError(
            f"ec2 backend: {operation} for {offer.pool} ({market}) got no answer from EC2 in {offer.region} after "
            f"botocore's retries: {exc}. Nothing to fix if it passes: the launch is tried again soon; if it "
            "lasts, check the network path to the EC2 endpoint (the AWS connection's endpoint_url, proxies)",
            capacity=False, transient=True, tried=[offer.pool],
        )
    if not code:  # a BotoCoreError that is not the network: no credentials, no region, a bad parameter
        return LaunchError(
            f"ec2 backend: cannot call {operation} in {offer.region}: {exc} (check the AWS connection: "
            "credentials, region, endpoint_url)", capacity=False, tried=[offer.pool],
        )
    error = exc.response.get("Error", {})
    message = str(error.get("Message", "")) or str(exc)
    if code in QUOTA_CODES:
        return LaunchError(
            f"{code} for {offer.pool} ({market}): {message}. This is the AWS account's quota, not the pool's "
            f"capacity: raise it in Service Quotas (EC2: the {'Spot Instance Requests' if offer.is_spot else 'Running On-Demand'} "
            f"quota of the {offer.instance_type.split('.')[0]} family's bucket, in vCPUs, in {offer.region}), or "
            "let the job use other instance families or markets", capacity=False, unusable=True, tried=[offer.pool])
    if code in CAPACITY_CODES or code == "Unsupported":
        # "Unsupported" is per zone: the same type may exist in the next pool
        return LaunchError(f"{code} for {offer.pool} ({market}): {message}", capacity=True, tried=[offer.pool])
    if is_transient(exc):
        what = "throttled the call" if code in THROTTLING_CODES else "failed on its side"
        return LaunchError(
            f"ec2 backend: EC2 {what} ({code}: {message}) on {operation} for {offer.pool} ({market}), after "
            "botocore's retries. Nothing to fix: the launch is tried again soon; if it lasts, check the AWS "
            f"Health Dashboard for EC2 in {offer.region} (and, for throttling, other callers of the same account)",
            capacity=False, transient=True, tried=[offer.pool],
        )
    hint = f" ({_HINTS[code]})" if code in _HINTS else ""
    return LaunchError(
        f"EC2 refused to launch {offer.instance_type} in {offer.zone}: {code}: {message}{hint}",
        capacity=False, tried=[offer.pool],
    )
