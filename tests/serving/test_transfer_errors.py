"""Every transport failure reaches the caller with the status its type names: `transfer_errors()`
(the services' seam between the transport and the contract) keeps each `TransferError`'s code, and
gives the reason the failure has: the caller's "gone" reason for a read whose data is no longer
there, OVERLOADED for a full pool, SERVER_STOPPED for this process's own agent closed."""

from __future__ import annotations

import pytest

from libs.contract.errors import EpdError
from libs.contract.reasons import Reason
from libs.serving.transport import transfer_errors
from libs.transfer import errors

pytestmark = pytest.mark.unit


def _subclasses(cls: type[errors.TransferError]) -> list[type[errors.TransferError]]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


@pytest.mark.parametrize("error", _subclasses(errors.TransferError), ids=lambda cls: cls.__name__)
def test_each_transfer_error_keeps_its_status(error: type[errors.TransferError]) -> None:
    with pytest.raises(EpdError) as raised, transfer_errors():
        raise error("what went wrong")
    assert raised.value.code == error.grpc_code
    assert "what went wrong" in raised.value.message


# The reason each transfer error carries out of a read that names EMBEDDING_GONE as "gone"; None:
# the failure is not about the data being gone (a bad handle, a timeout, a NIXL fault).
EMBEDDING_READ = {
    errors.StaleHandle: Reason.EMBEDDING_GONE,
    errors.PeerUnavailable: Reason.EMBEDDING_GONE,
    errors.ChecksumMismatch: Reason.EMBEDDING_GONE,
    errors.PoolExhausted: Reason.OVERLOADED,
    errors.AgentClosed: Reason.SERVER_STOPPED,
}


@pytest.mark.parametrize("error", _subclasses(errors.TransferError), ids=lambda cls: cls.__name__)
def test_each_transfer_error_carries_the_reason_of_its_meaning(error: type[errors.TransferError]) -> None:
    with pytest.raises(EpdError) as raised, transfer_errors(gone=Reason.EMBEDDING_GONE):
        raise error("what went wrong")
    assert raised.value.reason == EMBEDDING_READ.get(error)
    with pytest.raises(EpdError) as raised, transfer_errors():  # not a read of held data
        raise error("what went wrong")
    assert raised.value.reason == NOT_A_READ.get(error)


# Without a "gone" reason (a producer's put, not a read), only the process's own state has one.
NOT_A_READ = {errors.PoolExhausted: Reason.OVERLOADED, errors.AgentClosed: Reason.SERVER_STOPPED}
