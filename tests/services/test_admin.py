"""Admin over real gRPC: what the served stack holds, and Search keeping its query encoder paired with
the gallery when the production alias moves on its own."""

from datetime import datetime, timedelta, timezone

import grpc
import pytest

from clipstream.cli import main
from clipstream.registry import Registry
from clipstream.services.client import Client
from clipstream.v1 import admin_pb2, admin_pb2_grpc, encoder_pb2, search_pb2
from tests.services.conftest import set_production

pytestmark = pytest.mark.component  # the session's served app


def test_status_names_production_the_pinned_query_version_and_the_gallery(served, indexed):
    settings, channel, stub, (v1, v2) = served
    stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["load v1"]))
    status = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(admin_pb2.GetStatusRequest())
    assert (status.stream, status.production_version, status.query_version) == (settings.stream, v1, v1)
    assert status.index_generation == 1 and v1 in status.loaded_versions
    assert [(t.task, t.task_index, t.model_version, t.images, t.texts) for t in status.tasks] == [
        ("squares", 0, v1, 6, 6), ("discs", 1, v1, 6, 6)]
    assert status.consistent and not status.problems


def test_list_versions_newest_first_with_aliases_and_cache(served):
    _, channel, stub, (v1, v2) = served
    stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["load v1"]))
    versions = admin_pb2_grpc.AdminServiceStub(channel).ListVersions(admin_pb2.ListVersionsRequest()).versions
    assert [v.version for v in versions][-2:] == [v2, v1] and int(versions[0].version) >= int(v2)
    by = {v.version: v for v in versions}
    assert "production" in by[v1].aliases and by[v1].loaded and by[v1].method == "finetune"
    created = by[v2].created_at.ToDatetime(tzinfo=timezone.utc)
    assert abs(datetime.now(timezone.utc) - created) < timedelta(days=1) and by[v2].task == "t2"


def test_list_versions_a_page_at_a_time(served):
    """Pages of one version walk the whole list in order; the client's versions() follows the tokens itself; a token
    the server never gave is INVALID_ARGUMENT."""
    settings, channel, _, _ = served
    admin = admin_pb2_grpc.AdminServiceStub(channel)
    everything = [v.version for v in admin.ListVersions(admin_pb2.ListVersionsRequest()).versions]
    walked, token = [], ""
    while True:
        page = admin.ListVersions(admin_pb2.ListVersionsRequest(page_size=1, page_token=token))
        assert len(page.versions) == 1
        walked.append(page.versions[0].version)
        token = page.next_page_token
        if not token:
            break
    assert walked == everything and len(everything) >= 2
    with Client(f"127.0.0.1:{settings.grpc_port}", api_key=settings.secret("api_key")) as client:
        assert [v["version"] for v in client.versions(page_size=1)] == everything
    with pytest.raises(grpc.RpcError) as err:
        admin.ListVersions(admin_pb2.ListVersionsRequest(page_token="not-a-token"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "next_page_token" in err.value.details()


def test_an_alias_moved_outside_promotion_does_not_switch_search_and_status_says_so(served, indexed):
    settings, channel, stub, (v1, v2) = served
    search = indexed[1]
    set_production(settings, stub, v2)
    try:
        # the gallery holds v1's vectors: queries stay with v1 until a promotion pins v2 with its gallery
        assert search.Search(search_pb2.SearchRequest(text="a red square", k=3)).query_model_version == v1
        status = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(admin_pb2.GetStatusRequest())
        assert (status.production_version, status.query_version, status.consistent) == (v2, v1, False)
        assert any(f"production is v{v2} but the gallery serves queries for v{v1}" in p for p in status.problems)
        with Registry(settings).lock(f"mlflow to {v2}"):  # what a follower holds while it indexes v2's gallery
            status = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(admin_pb2.GetStatusRequest())
        assert any(f"mlflow to {v2} in progress" in p and f"queries stay with v{v1}" in p for p in status.problems)
    finally:
        set_production(settings, stub, v1)


def test_cli_status_prints_versions_tasks_and_consistency(served, indexed, capsys):
    settings = served[0]
    assert main(["status", "--address", f"127.0.0.1:{settings.grpc_port}"]) == 0
    out = capsys.readouterr().out
    assert f"queries encoded by v{served[3][0]}" in out and "squares" in out and "discs" in out
    assert "version" in out and "production" in out
