"""The family contract (tests/models/contract.py) over every tiny flavour of every family in the table, and the
edit contract over every edit flavour the table lists."""

from __future__ import annotations

import pytest

from simpletuner.config import family_names, get_family
from simpletuner.config.families import tiny_flavours
from tests.models.contract import EditFlavourContract, FamilyContract, edit_cases

# every tiny flavour of every family: Wan has one per architecture (T2V, I2V, 2.2's experts)
CASES = [(name, flavour) for name in family_names() for flavour in tiny_flavours(get_family(name))]


@pytest.fixture(scope="class", params=CASES, ids=[n if f == "tiny" else f"{n}[{f}]" for n, f in CASES])
def case(request):
    return request.param


@pytest.fixture(scope="class")
def family(case):
    return case[0]


class TestFamilyContract(FamilyContract):
    @pytest.fixture(scope="class")
    def flavour(self, case):
        return case[1]


class TestEditFlavourContract(EditFlavourContract):
    @pytest.fixture(scope="class", params=edit_cases(), ids=lambda case: "-".join(case))
    def case(self, request):
        """(family, edit flavour)."""
        return request.param
