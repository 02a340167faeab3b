"""The family contract (tests/models/contract.py) over every family in the table."""

from __future__ import annotations

import pytest

from simpletuner.config import family_names
from tests.models.contract import FamilyContract


@pytest.fixture(scope="class", params=family_names())
def family(request):
    return request.param


class TestFamilyContract(FamilyContract):
    pass
