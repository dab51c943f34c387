"""Two replicas of one endpoint that read two revisions of a tenant's model (its branch moved, or its store's files
were replaced, between their starts) are reserved for the costlier of the two while both run.

A tenant's copy of a model (its own scope) is keyed by its source, not its content: each node running a replica reports
what it read, and the last report stood. So the prompt bound flipped with every heartbeat, to the cheaper revision's
context and tokenizer while a replica of the costlier one served (its prompts past the bound were free).
"""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from endpoints import replicas
from endpoints.fleet.services import record_model_facts
from endpoints.gateway.estimate import worst_case
from endpoints.gateway.normalizers import prompt_normalizer
from endpoints.models import ModelFacts, Replica
from endpoints.replicas import record_chat_template_tokens
from gpu_agent.protocol import (
    MAX_DIFFERING_TOKENIZERS,
    ChatTemplateTokens,
    ModelInfo,
    NormalizerStep,
    ReplicaState,
    TokenizerNormalizer,
    WeightsStatus,
)
from tests.factories import EndpointFactory, OrganizationFactory, make_credential
from tests.test_placement import make_node

pytestmark = pytest.mark.django_db

SOURCE = "hf:tenant/own-model"
# Revision 1: a long context, and a tokenizer that makes each space 9 "▁" (27 bytes); revision 2: neither.
NINE_MARKS = TokenizerNormalizer(steps=[NormalizerStep(kind="replace", pattern=" ", content="\u2581" * 9)])
COSTLY = ModelInfo(max_model_len=32768, architecture="LlamaForCausalLM", tokenizer_normalizer=NINE_MARKS)
CHEAP = ModelInfo(
    max_model_len=2048, architecture="LlamaForCausalLM", tokenizer_normalizer=TokenizerNormalizer()
)
SPACES = {"messages": [{"role": "user", "content": " " * 1000}], "max_tokens": 1}


@pytest.fixture
def endpoint():
    organization = OrganizationFactory()
    return EndpointFactory(
        organization=organization, model_source=SOURCE, credential=make_credential(organization)
    )


def _running(endpoint, info):
    node = make_node(gpu_type=endpoint.gpu_type)
    replica = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    return node, replica, info


def _heartbeat(endpoint, node, info):
    status = WeightsStatus(
        source=SOURCE,
        cache_key=f"copy-{node.pk}",
        size_bytes=1 << 30,
        complete=True,
        model_info=info,
        scope=endpoint.weights_scope,
    )
    record_model_facts(node, [status])


def _bound(endpoint) -> int:
    endpoint.refresh_from_db()
    normalizer = prompt_normalizer(endpoint.tokenizer_normalizer)
    return worst_case(SPACES, "chat", endpoint.context_length, normalizer=normalizer).num_prompt_tokens


def _bound_by(endpoint, info) -> int:
    """`_bound` by one reading's tokenizer alone."""
    normalizer = prompt_normalizer(info.tokenizer_normalizer.to_dict())
    return worst_case(SPACES, "chat", endpoint.context_length, normalizer=normalizer).num_prompt_tokens


def test_two_revisions_of_a_tenants_model_are_reserved_for_the_costlier_whichever_reported_last(endpoint):
    costly, cheap = _running(endpoint, COSTLY), _running(endpoint, CHEAP)
    _heartbeat(endpoint, *costly[::2])
    costly_bound = _bound(endpoint)
    assert costly_bound > 9 * 1000

    for node, _, info in (cheap, costly, cheap, cheap, costly, cheap):
        _heartbeat(endpoint, node, info)
        endpoint.refresh_from_db()

        assert endpoint.context_length == 32768
        assert _bound(endpoint) >= costly_bound


def test_the_cheaper_revision_alone_is_reserved_as_itself_once_the_other_replica_stops(endpoint):
    costly, cheap = _running(endpoint, COSTLY), _running(endpoint, CHEAP)
    for node, _, info in (costly, cheap):
        _heartbeat(endpoint, node, info)
    Replica.objects.filter(pk=costly[1].pk).update(state=ReplicaState.STOPPED)

    _heartbeat(endpoint, *cheap[::2])

    endpoint.refresh_from_db()
    assert endpoint.context_length == 2048
    assert prompt_normalizer(endpoint.tokenizer_normalizer) is None


def test_one_revision_on_two_nodes_is_reserved_as_itself(endpoint):
    for node, _, info in (_running(endpoint, COSTLY), _running(endpoint, COSTLY)):
        _heartbeat(endpoint, node, info)

    endpoint.refresh_from_db()
    assert endpoint.context_length == 32768
    assert endpoint.tokenizer_normalizer == NINE_MARKS.to_dict()


def _counted(endpoint, replica, per_conversation):
    """A READY replica's engine's count of its chat template, as its node's heartbeat carries it."""
    measured = ChatTemplateTokens(
        per_conversation=per_conversation,
        per_message=8,
        model_source=SOURCE,
        weights_scope=endpoint.weights_scope,
    )
    record_chat_template_tokens(endpoint, measured, node_id=replica.node_id, replica_id=replica.pk)


def test_two_revisions_chat_templates_are_allowed_the_larger_count(endpoint):
    (_, first, _), (_, second, _) = _running(endpoint, COSTLY), _running(endpoint, CHEAP)
    for replica, per_conversation in ((first, 900), (second, 40)):
        _counted(endpoint, replica, per_conversation)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (900, 8)


def test_two_revisions_chat_templates_on_one_node_are_allowed_the_larger_count(endpoint):
    # Two replicas on one node (started before and after the branch moved): both heard on every heartbeat.
    node, costly, _ = _running(endpoint, COSTLY)
    cheap = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    for replica, per_conversation in ((costly, 900), (cheap, 40), (costly, 900), (cheap, 40)):
        _counted(endpoint, replica, per_conversation)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (900, 8)  # was (40, 8): the node's last claim replaced its first


def test_a_second_endpoint_of_the_same_copy_on_one_node_does_not_lower_the_count(endpoint):
    other = EndpointFactory(
        organization=endpoint.organization, model_source=SOURCE, credential=endpoint.credential
    )
    assert other.weights_scope == endpoint.weights_scope
    node, replica, _ = _running(endpoint, COSTLY)
    others = Replica.objects.create(endpoint=other, node=node, state=ReplicaState.READY)

    _counted(endpoint, replica, 900)
    _counted(other, others, 40)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (900, 8)


def test_the_cheaper_template_alone_is_counted_once_the_costlier_replica_on_its_node_stops(endpoint):
    node, costly, _ = _running(endpoint, COSTLY)
    cheap = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    _counted(endpoint, costly, 900)
    _counted(endpoint, cheap, 40)
    Replica.objects.filter(pk=costly.pk).update(state=ReplicaState.STOPPED)

    successor = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    _counted(endpoint, successor, 40)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (40, 8)


def test_two_revisions_cached_on_one_node_are_reserved_for_the_costlier_whichever_was_used_last(endpoint):
    node, _, _ = _running(endpoint, COSTLY)
    Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    copies = [
        WeightsStatus(
            source=SOURCE,
            cache_key=key,
            size_bytes=1 << 30,
            complete=True,
            last_used_at=used_at,
            model_info=info,
            scope=endpoint.weights_scope,
        )
        for key, used_at, info in (("revision-1", 1.0, COSTLY), ("revision-2", 2.0, CHEAP))
    ]

    record_model_facts(node, copies)

    endpoint.refresh_from_db()
    assert endpoint.context_length == 32768
    # each prompt its larger bound of the two tokenizers': the costlier's (before: the context)
    assert _bound(endpoint) == _bound_by(endpoint, COSTLY) > 9 * 1000


def test_a_steady_heartbeat_beside_a_costlier_revision_locks_and_writes_nothing(endpoint):
    # The costlier revision's replica sleeps on another node (no cost to its tenant): its claim raises the cheap
    # node's, and each of the cheap node's beats ran `learn` (a savepoint, SELECT ... FOR UPDATE, the replicas' join).
    cheap, costly = _running(endpoint, CHEAP), _running(endpoint, COSTLY)
    Replica.objects.filter(pk=costly[1].pk).update(state=ReplicaState.SLEEPING)
    _heartbeat(endpoint, *costly[::2])
    _heartbeat(endpoint, *cheap[::2])

    with CaptureQueriesContext(connection) as beat:
        _heartbeat(endpoint, *cheap[::2])

    statements = [query["sql"] for query in beat.captured_queries]
    assert not any("FOR UPDATE" in sql or sql.startswith(("UPDATE", "SAVEPOINT")) for sql in statements)
    assert len(statements) <= 3  # this node's replicas, the copy's facts, the copy's live replicas (was 8)
    endpoint.refresh_from_db()
    assert endpoint.context_length == 32768


def test_a_replicas_count_lowered_and_raised_again_is_kept_raised(endpoint):
    # An engine relaunched on another revision and back: the count last kept was a set of every count seen, so the
    # raised one (seen before) was never learned again: 40 kept while the engine added 900 (a review's finding).
    replicas._kept_template_counts.clear()
    _node, replica, _ = _running(endpoint, COSTLY)
    for count in (900, 40, 900):
        _counted(endpoint, replica, count)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (900, 8)


def test_a_count_another_web_process_replaced_is_learned_again_within_a_minute(endpoint):
    replicas._kept_template_counts.clear()
    _node, replica, _ = _running(endpoint, COSTLY)
    _counted(endpoint, replica, 900)
    first_process = dict(replicas._kept_template_counts)
    replicas._kept_template_counts.clear()
    _counted(endpoint, replica, 40)  # another process
    replicas._kept_template_counts.clear()
    replicas._kept_template_counts.update(
        {
            claimant: (counts, kept_at - replicas.KEPT_TEMPLATE_COUNT_S)
            for claimant, (counts, kept_at) in first_process.items()
        }
    )

    _counted(endpoint, replica, 900)  # back on the first, a minute on

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (900, 8)


def test_a_template_count_a_node_claimed_before_counts_were_a_replicas_goes_with_the_next_heartbeat(endpoint):
    # Kept under the node's key by the code before: it stood while that node ran any replica of the copy.
    replicas._kept_template_counts.clear()
    node, costly, _ = _running(endpoint, COSTLY)
    _heartbeat(endpoint, node, CHEAP)
    facts = ModelFacts.objects.get(source=SOURCE, scope=endpoint.weights_scope)
    old_claim = facts.disputed[str(node.pk)] | {
        "template_tokens_per_conversation": 900,
        "template_tokens_per_message": 8,
    }
    ModelFacts.objects.filter(pk=facts.pk).update(
        disputed={str(node.pk): old_claim},
        template_tokens_per_conversation=900,
        template_tokens_per_message=8,
    )
    Replica.objects.filter(pk=costly.pk).update(state=ReplicaState.STOPPED)
    cheap = Replica.objects.create(endpoint=endpoint, node=node, state=ReplicaState.READY)
    _counted(endpoint, cheap, 40)

    _heartbeat(endpoint, node, CHEAP)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (40, 8)


def _two_replicas_counted(endpoint, first_count, second_count, *, second_state=ReplicaState.READY):
    """A node running two replicas of the copy, each of which counted its chat template, after a heartbeat."""
    replicas._kept_template_counts.clear()
    node, first, _ = _running(endpoint, CHEAP)
    second = Replica.objects.create(endpoint=endpoint, node=node, state=second_state)
    _heartbeat(endpoint, node, CHEAP)
    _counted(endpoint, first, first_count)
    _counted(endpoint, second, second_count)
    return node, first, second


def test_a_steady_heartbeat_of_a_copy_served_from_its_node_alone_asks_nothing_of_the_fleets_replicas(
    endpoint,
):
    # Its replica's chat template count is a claim of its own beside its node's: each beat asked the database whether
    # that replica still ran (every live replica of the source, any tenant's, sorted out in Python), though the beat
    # had just read the node's live replicas. The same for a second replica of the copy on the node.
    node, _, _ = _two_replicas_counted(endpoint, 40, 40, second_state=ReplicaState.SLEEPING)
    _heartbeat(endpoint, node, CHEAP)

    with CaptureQueriesContext(connection) as beat:
        _heartbeat(endpoint, node, CHEAP)

    assert len(beat.captured_queries) == 2  # this node's replicas, the copy's facts (was 3)
    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (40, 8)


def test_a_claim_of_a_replica_stopped_on_the_reporting_node_goes_with_its_next_heartbeat(endpoint):
    # What the beat knows of its own node stands for the question (not a stale answer): a stopped replica's claim goes.
    node, costly, _ = _two_replicas_counted(endpoint, 900, 40)
    Replica.objects.filter(pk=costly.pk).update(state=ReplicaState.STOPPED)

    _heartbeat(endpoint, node, CHEAP)

    endpoint.refresh_from_db()
    assert endpoint.chat_template_tokens == (40, 8)


# One revision of the files, described by two agent versions (a describer fixed between them: the older missed the
# pre-tokenizer's "▁" before each piece, which the newer reads).
OLDER_AGENTS = ModelInfo(
    max_model_len=32768, architecture="LlamaForCausalLM", tokenizer_normalizer=TokenizerNormalizer()
)
NEWER_AGENTS = ModelInfo(
    max_model_len=32768,
    architecture="LlamaForCausalLM",
    tokenizer_normalizer=TokenizerNormalizer(steps=[NormalizerStep(kind="prepend", content="\u2581")]),
)


def test_during_an_agent_rollout_a_copy_on_both_versions_nodes_is_reserved_the_larger_of_their_bounds(
    endpoint,
):
    # The control plane cannot tell two agent versions' descriptions of one revision from two revisions (whose engines
    # may split differently): every replica's engine reads one of the two, so each prompt is reserved the larger of its
    # two bounds. Before, the whole context: 32,768 prompt tokens for this 1,000-space chat, 1,084 or 1,090 by either.
    (old, _, _), (upgraded, _, _) = _running(endpoint, OLDER_AGENTS), _running(endpoint, OLDER_AGENTS)
    _heartbeat(endpoint, old, OLDER_AGENTS)
    _heartbeat(endpoint, upgraded, OLDER_AGENTS)
    before = _bound(endpoint)

    _heartbeat(endpoint, upgraded, NEWER_AGENTS)  # one node of the copy upgraded
    during = _bound(endpoint)
    _heartbeat(endpoint, old, NEWER_AGENTS)  # the last one upgraded: its next heartbeat
    after = _bound(endpoint)

    assert before == _bound_by(endpoint, OLDER_AGENTS) < after == _bound_by(endpoint, NEWER_AGENTS)
    assert during == max(before, after)
    endpoint.refresh_from_db()
    assert (
        endpoint.tokenizer_normalizer == NEWER_AGENTS.tokenizer_normalizer.to_dict()
    )  # once all are upgraded


def test_tokenizers_differing_past_the_alternatives_kept_or_one_unknown_reserve_the_context(endpoint):
    unknown = ModelInfo(
        max_model_len=32768,
        architecture="LlamaForCausalLM",
        tokenizer_normalizer=TokenizerNormalizer(unknown="x"),
    )
    many = [
        ModelInfo(
            max_model_len=32768,
            architecture="LlamaForCausalLM",
            tokenizer_normalizer=TokenizerNormalizer(num_special_tokens=count),
        )
        for count in range(MAX_DIFFERING_TOKENIZERS + 1)
    ]
    for info in (OLDER_AGENTS, unknown):
        _heartbeat(endpoint, _running(endpoint, info)[0], info)
    assert _bound(endpoint) == 32768

    Replica.objects.filter(endpoint=endpoint).update(state=ReplicaState.STOPPED)
    for info in many:
        _heartbeat(endpoint, _running(endpoint, info)[0], info)
    assert _bound(endpoint) == 32768
