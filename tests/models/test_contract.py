"""The family contract (tests/models/contract.py) over every family in the table, and the edit contract over every
edit flavour the table lists."""

from __future__ import annotations

import pytest

from simpletuner.config import family_names
from tests.models.contract import EditFlavourContract, FamilyContract, edit_cases


@pytest.fixture(scope="class", params=family_names())
def family(request):
    return request.param


class TestFamilyContract(FamilyContract):
    pass


@pytest.fixture(scope="class", params=edit_cases(), ids=lambda case: "-".join(case))
def case(request):
    return request.param


class TestEditFlavourContract(EditFlavourContract):
    pass
