"""specdec/engine_types.py: the batch admission rule shared by tree and chain verification."""


def test_admit_batch_refuses_a_session_twice_and_keeps_answers_apart_from_jobs():
    from types import SimpleNamespace

    from specdec.engine_types import admit_batch
    from specdec.errors import InvalidRequest, SessionFinished

    class Job:
        pass

    def admit_one(i, r):
        if r.what == "bad":
            raise SessionFinished("finished")
        return Job() if r.what == "job" else f"answer {i}"

    reqs = [SimpleNamespace(sid=s, what=w) for s, w in
            [("a", "bad"), ("a", "job"), ("b", "answer"), ("a", "job"), ("b", "job"), ("c", "job")]]
    out, jobs = admit_batch(reqs, admit_one, Job)
    assert isinstance(out[0], SessionFinished) and out[1] is None and out[2] == "answer 2"
    assert isinstance(out[3], InvalidRequest) and isinstance(out[4], InvalidRequest)  # a refused one does not count
    assert out[5] is None and len(jobs) == 2 and all(isinstance(j, Job) for j in jobs)
