"""A Ray replica's answer, or its replacement (`generator/ray/health.answer`): a call that a
killed actor still holds after Ray restarted it must not wait forever (under load, one did for
600 s in `test_a_killed_replica_loses_no_request_and_comes_back_with_every_live_version`)."""

import asyncio

import pytest

from lora_async.generator.ray.health import ReplicaGone, ReplicaState, answer


def _replica() -> ReplicaState:
    return ReplicaState(index=0, actor=None, slot=None)


def test_an_answer_that_comes_is_returned_and_leaves_nothing_pending():
    async def main():
        replica = _replica()
        result = await answer(asyncio.sleep(0, result="tokens"), replica.gone, "replica 0")
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.sleep(0)  # let the cancelled waiter finish
        return result, [t for t in others if not t.done()]
    result, pending = asyncio.run(main())
    assert result == "tokens" and pending == []


def test_a_call_held_by_a_replaced_replica_ends_with_replica_gone_and_is_cancelled():
    async def main():
        replica = _replica()
        never = asyncio.get_running_loop().create_future()  # what a killed actor's call can stay
        asyncio.get_running_loop().call_soon(replica.replaced)
        with pytest.raises(ReplicaGone, match="replica 0: its process was replaced"):
            await answer(never, replica.gone, "replica 0")
        return never
    assert asyncio.run(main()).cancelled()


def test_the_replicas_own_error_is_raised_as_it_is():
    async def main():
        async def dies():
            raise ConnectionError("actor died")
        with pytest.raises(ConnectionError, match="actor died"):
            await answer(dies(), _replica().gone, "replica 0")
    asyncio.run(main())


def test_a_call_to_the_new_incarnation_is_not_ended_by_the_old_ones_replacement():
    async def main():
        replica = _replica()
        replica.replaced()  # the old incarnation's calls were woken; this one is new
        answered = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(answered.set_result, "served")
        return await answer(answered, replica.gone, "replica 0")
    assert asyncio.run(main()) == "served"
