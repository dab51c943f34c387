"""Composed Lua scripts: each part's keys and arguments sit where the composer computed, against the
real (embedded) Redis, and a part given the wrong number of them is refused before anything runs."""

import asyncio

import pytest

from controlplane.redis_client import get_redis
from controlplane.script_parts import ComposedScript, ScriptPart
from endpoints.gateway import admission

# Each function reads only its own K and A, from 1.
LIBRARY = """
local function echo(K, A) return {K[1], K[#K], A[1], A[#A]} end
local function add(K, A) return redis.call('INCRBY', K[1], A[1]) end
"""
FIRST = ScriptPart("first", keys=("a", "b"), args=("x", "y", "z"), lua=LIBRARY)
SECOND = ScriptPart("second", keys=("counter",), args=("by",), lua=LIBRARY)
REST = ScriptPart("rest", keys=(), args=("ttl",), lua=LIBRARY, variadic_keys=True)

COMPOSED = ComposedScript([FIRST, SECOND, REST], glue="""
local seen = echo(first_K, first_A)
seen[#seen + 1] = add(second_K, second_A)
seen[#seen + 1] = #rest_K
seen[#seen + 1] = rest_A[1]
return seen
""")


def test_each_part_reads_its_own_keys_and_arguments_at_the_offsets_the_composer_computed():
    get_redis().delete("composed:counter")

    async def run():
        return await COMPOSED(first=(["a1", "b1"], ["x1", "y1", "z1"]), second=(["composed:counter"], [5]),
                              rest=(["r1", "r2", "r3"], [60]))

    assert COMPOSED.offsets == {"first": (1, 1), "second": (3, 4), "rest": (4, 5)}
    assert asyncio.run(run()) == ["a1", "b1", "x1", "z1", 5, 3, "60"]
    assert COMPOSED.keys_and_args(first=(["a", "b"], [1, 2, 3]), second=(["c"], [4]), rest=([], [5])) == (
        ["a", "b", "c"], [1, 2, 3, 4, 5])


def test_a_part_given_the_wrong_number_of_keys_or_arguments_is_refused_before_anything_runs():
    get_redis().delete("composed:counter")

    async def run(**values):
        return await COMPOSED(**values)

    with pytest.raises(ValueError, match="first takes 2 keys"):
        asyncio.run(run(first=(["a1"], ["x", "y", "z"]), second=(["composed:counter"], [5]), rest=([], [60])))
    with pytest.raises(ValueError, match="second takes 1 arguments"):
        asyncio.run(run(first=(["a", "b"], ["x", "y", "z"]), second=(["composed:counter"], [5, 6]), rest=([], [60])))
    with pytest.raises(ValueError, match="expected keys and arguments for"):
        asyncio.run(run(first=(["a", "b"], ["x", "y", "z"]), rest=([], [60])))
    assert get_redis().get("composed:counter") is None  # nothing ran


def test_a_part_of_any_number_of_keys_is_refused_fewer_than_it_declares_and_every_wrong_count_names_its_part():
    tail = ScriptPart("tail", keys=("one at least",), args=("ttl",), lua=LIBRARY, variadic_keys=True)
    composed = ComposedScript([SECOND, tail], glue="return 0")
    assert composed.keys_and_args(second=(["c"], [1]), tail=(["t1", "t2", "t3"], [9])) == (["c", "t1", "t2", "t3"], [1, 9])
    assert composed.keys_and_args(second=(["c"], [1]), tail=(("t1",), (9,))) == (["c", "t1"], [1, 9])  # tuples too
    with pytest.raises(ValueError, match="tail takes 1 or more keys"):
        composed.keys_and_args(second=(["c"], [1]), tail=([], [9]))
    with pytest.raises(ValueError, match="tail takes 1 arguments"):
        composed.keys_and_args(second=(["c"], [1]), tail=(["t1", "t2"], []))
    with pytest.raises(ValueError, match="second takes 1 keys"):
        composed.keys_and_args(second=(["c", "d"], [1]), tail=(["t1"], [9]))
    with pytest.raises(ValueError, match="second takes 1 keys"):
        composed.keys_and_args(second=([], [1]), tail=(["t1", "t2"], [9]))  # the keys' total right, the part's not


def test_only_the_last_part_may_take_any_number_of_keys_and_names_are_unique_lua_names():
    with pytest.raises(ValueError, match="only the last part"):
        ComposedScript([REST, FIRST], glue="return 0")
    with pytest.raises(ValueError, match="share a name"):
        ComposedScript([FIRST, FIRST], glue="return 0")
    with pytest.raises(ValueError, match="Lua name"):
        ScriptPart("not a name", keys=(), args=(), lua="")


def test_the_gateways_scripts_lay_out_their_parts_as_each_declares():
    assert admission._ADMIT.offsets == {"limits_check": (1, 1), "quota_reserve": (4, 5), "traffic_begin": (11, 11),
                                        "traffic_pick": (14, 14)}
    assert admission._FINISH.offsets == {"traffic_end": (1, 1), "limits_give_back": (6, 4), "routing_learn": (8, 7),
                                         "quota_settle": (9, 10)}
