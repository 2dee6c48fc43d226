"""EC2 errors sorted into "try the next offer" (capacity) and "fix your configuration", with the fix."""
from __future__ import annotations

from airflow_spot.backends.base import LaunchError
from airflow_spot.policy.offers import Offer

#: a pool is full or our quota is used up: another pool (or later) may work
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "MaxSpotInstanceCountExceeded", "VcpuLimitExceeded",
    "SpotMaxPriceTooLow", "InsufficientFreeAddressesInSubnet", "InstanceLimitExceeded",
})

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


def launch_error(exc, offer: Offer) -> LaunchError:
    """A :class:`LaunchError` for a botocore ``ClientError`` raised by a launch of ``offer``."""
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    message = str(error.get("Message", "")) or str(exc)
    if code in CAPACITY_CODES or code == "Unsupported":
        # "Unsupported" is per zone: the same type may exist in the next pool
        market = getattr(offer.market, "value", offer.market)
        return LaunchError(f"{code} for {offer.pool} ({market}): {message}", capacity=True, tried=[offer.pool])
    hint = f" ({_HINTS[code]})" if code in _HINTS else ""
    return LaunchError(
        f"EC2 refused to launch {offer.instance_type} in {offer.zone}: {code}: {message}{hint}",
        capacity=False, tried=[offer.pool],
    )
