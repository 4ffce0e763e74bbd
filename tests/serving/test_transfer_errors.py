"""Every transport failure reaches the caller with the status its type names: `transfer_errors()`
(the services' seam between the transport and the contract) keeps each `TransferError`'s code."""

from __future__ import annotations

import pytest

from libs.contract.errors import EpdError
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
