def test_healthz_answers_without_touching_the_database(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_checks_database_redis_and_the_usage_journals_room(db, client):
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json()["checks"] == {"database": "ok", "redis": "ok", "usage_journal": "ok", "process": "ok"}


def test_readiness_probes_leave_no_database_session_behind(transactional_db, tmp_path):
    # The probe's check ran in a thread of its own request, and its connection (kept for reuse, CONN_MAX_AGE) stayed
    # open after the thread was gone: one idle session per probe, every 5 s per pod, until PostgreSQL refused
    # clients (found by the usage journal's helper).
    import httpx
    from django.db import connection

    from tests.conftest import start_web_server

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()")
            return cursor.fetchone()[0]

    child, base_url = start_web_server(tmp_path)
    try:
        assert httpx.get(f"{base_url}/readyz", timeout=30).status_code == 200
        before = sessions()
        for _ in range(20):
            assert httpx.get(f"{base_url}/readyz", timeout=30).status_code == 200
        assert sessions() - before <= 1
    finally:
        child.stop()
