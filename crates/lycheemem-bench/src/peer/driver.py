"""Feeds one benchmark item to a peer memory system and asks it for each question's memories.

Run by the lycheemem harness (`lycheemem-bench run --variants mem0`, crate lycheemem-bench,
module `peer`) inside the pinned peer venv (`cargo xtask peer-venv`):

    python driver.py JOB.json

The job (JSON) names the peer, its state folder, the loopback OpenAI-compatible endpoint the
harness serves its own local LLM and embedder on, the item's sessions and the questions. The
driver adds the conversation unit by unit, as each peer's documentation prescribes:

- mem0: exchange by exchange (two consecutive turns of a session),
  `add(messages, user_id=..., metadata=...)`;
- A-Mem: turn by turn, `add_note(content, time=...)`, one note per turn with the session's
  date, as the authors' LoCoMo evaluation does;

posting each finished unit to the harness's `/lycheemem/checkpoint`, which writes it to
`progress.json` with the build's cost so far, so a killed build resumes where it stopped and
counts only the calls of its finished units.
Then it searches every question (top k) and writes one JSON line per question to `hits_out`.
Each memory carries the session, date and turn indices it was made from, so the harness
measures evidence recall exactly as for its own variants.

Progress goes to stderr; the last stdout line is a JSON summary. The driver stops when its
stdin, a pipe the harness holds open, closes (the harness is gone).
"""

import json
import logging
import os
import sys
import time
import urllib.request


def exchanges(sessions):
    """Consecutive turn pairs of each session (an odd last turn alone)."""
    for s in sessions:
        turns = s["turns"]
        for i in range(0, len(turns), 2):
            group = turns[i : i + 2]
            key = f"{s['id']}#{group[0]['index']}-{group[-1]['index']}"
            yield key, s, group


def single_turns(sessions):
    """Each turn of each session on its own."""
    for s in sessions:
        for t in s["turns"]:
            yield f"{s['id']}#{t['index']}", s, [t]


def messages_for(group, first_speaker):
    out = []
    for t in group:
        if t.get("speaker"):
            # Two people talking (LoCoMo): the item's first speaker is the "user", the other the
            # "assistant"; names stay in the text so the peer can attribute facts.
            role = "user" if t["speaker"] == first_speaker else "assistant"
            out.append({"role": role, "content": f"{t['speaker']}: {t['text']}"})
        else:
            out.append({"role": t["role"], "content": t["text"]})
    return out


# The date of the exchange being added (ISO day), see `open_mem0`.
OBSERVED = {"date": None}


def iso_day(date):
    return date[:10] if date and len(date) >= 10 and date[4] == "-" and date[7] == "-" else None


def open_mem0(job):
    os.environ.setdefault("MEM0_TELEMETRY", "False")
    os.environ["MEM0_DIR"] = os.path.join(job["store_dir"], "mem0-home")
    from mem0 import Memory
    import mem0.memory.main as mem0_main

    # mem0's open-source `add` takes no timestamp (its platform API does) and dates every
    # extraction prompt "today". Each exchange is given its session's date as the observation
    # and current date instead: relative dates resolve as on the day, and the prompts are the
    # same on every run, so a rebuild replays the harness's logged calls.
    extraction_prompt = mem0_main.generate_additive_extraction_prompt

    def dated_extraction_prompt(*args, **kwargs):
        if OBSERVED["date"]:
            kwargs.setdefault("current_date", OBSERVED["date"])
            kwargs.setdefault("timestamp", OBSERVED["date"])
        return extraction_prompt(*args, **kwargs)

    mem0_main.generate_additive_extraction_prompt = dated_extraction_prompt

    endpoint = {"openai_base_url": job["base_url"], "api_key": "local"}
    config = {
        "llm": {
            "provider": "openai",
            "config": {
                "model": job["llm_model"],
                "temperature": 0.0,
                "max_tokens": job.get("max_tokens", 2000),
                **endpoint,
            },
        },
        "embedder": {
            "provider": "openai",
            "config": {
                "model": job["embed_model"],
                "embedding_dims": job["embedding_dims"],
                **endpoint,
            },
        },
        "vector_store": {
            "provider": "qdrant",
            "config": {
                "collection_name": "memories",
                "path": os.path.join(job["store_dir"], "qdrant"),
                "embedding_model_dims": job["embedding_dims"],
                "on_disk": True,
            },
        },
        "history_db_path": os.path.join(job["store_dir"], "history.db"),
    }
    global MEM0_UNIT_FAILURES
    import openai
    from mem0.exceptions import LLMError

    MEM0_UNIT_FAILURES = (LLMError, openai.APIError)
    return Memory.from_config(config)


def mem0_add(memory, job, key, session, group, first_speaker):
    """Adds one exchange; true when it failed. mem0 logs an extraction reply it cannot parse
    (and a memory it cannot insert) and carries on with nothing stored; its extraction call
    failing for good (after its client's retries) raises its `LLMError` (or the client's
    `APIError`). Either way the unit is counted failed and the build goes on, as A-Mem's failed
    calls are. Any other exception (a programming error, a changed API) ends the build."""
    OBSERVED["date"] = iso_day(session.get("date"))
    errors = MEM0_ERRORS.count
    try:
        memory.add(
            messages_for(group, first_speaker),
            user_id=job["user_id"],
            metadata={
                "session": session["id"],
                "session_date": session.get("date"),
                "turns": [t["index"] for t in group],
            },
        )
    except MEM0_UNIT_FAILURES as e:
        print(f"mem0 {job['user_id']}: unit {key} failed: {e!r}", file=sys.stderr, flush=True)
        return True
    return MEM0_ERRORS.count > errors


def speakers(job):
    """Role → name when two named people talk (LoCoMo): mem0 writes facts about "User" and
    marks each memory `attributed_to` user or assistant; the name is what an application that
    knows who its user is would show, and what mem0's own LoCoMo evaluation gave its answerer
    (one memory list per speaker)."""
    names = []
    for s in job["sessions"]:
        for t in s["turns"]:
            if t.get("speaker") and t["speaker"] not in names:
                names.append(t["speaker"])
    return dict(zip(["user", "assistant"], names)) if len(names) == 2 else {}


def mem0_search(memory, job, question):
    found = memory.search(
        question,
        top_k=job["top_k"],
        filters={"user_id": job["user_id"]},
        # Every system in the comparison hands the answerer k items.
        threshold=0.0,
    )
    names = speakers(job)
    hits = []
    for r in found.get("results", []):
        meta = r.get("metadata") or {}
        text = r.get("memory", "")
        who = names.get(r.get("attributed_to") or meta.get("attributed_to") or "")
        if who:
            text = f"[{who}] {text}"
        hits.append(
            {
                "id": str(r.get("id")),
                "memory": text,
                "score": float(r.get("score") or 0.0),
                "session": meta.get("session"),
                "session_date": meta.get("session_date"),
                "turns": meta.get("turns") or [],
            }
        )
    return hits


def mem0_count(memory, job):
    found = memory.get_all(filters={"user_id": job["user_id"]}, top_k=1_000_000)
    return len(found.get("results", []))


def amem_time(date):
    """A-Mem's timestamp format, YYYYMMDDHHMM (midnight when the session gives only a day)."""
    if not date or len(date) < 10:
        return None
    digits = date[:4] + date[5:7] + date[8:10]
    clock = date[11:16].replace(":", "") if len(date) >= 16 else "0000"
    stamp = digits + clock
    return stamp if stamp.isdigit() and len(stamp) == 12 else None


class ErrorCount(logging.Handler):
    """Counts the errors a peer logs and carries on from (A-Mem logs a failed evolution call,
    mem0 an extraction reply it could not parse)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record):
        self.count += 1


AMEM_ERRORS = ErrorCount()
MEM0_ERRORS = ErrorCount()
# The exceptions of a mem0 add that fail its unit only (set when mem0 is opened: its LLM call
# failed for good); any other ends the build.
MEM0_UNIT_FAILURES = ()
# mem0 logs an extraction reply it could not parse, and a memory it could not insert, on this
# logger and carries on; count them.
logging.getLogger("mem0.memory.main").addHandler(MEM0_ERRORS)
# What A-Mem's `analyze_content` returns when its LLM call or the reply's parsing failed.
AMEM_NO_ANALYSIS = {"keywords": [], "context": "General", "tags": []}


def open_amem(job):
    import types

    # A-Mem imports sentence-transformers and transformers at module level but, with its
    # embedder replaced below, never calls them; they would pull torch into the venv.
    for name, attrs in (
        ("sentence_transformers", ("SentenceTransformer",)),
        ("transformers", ("AutoModel", "AutoTokenizer")),
    ):
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            for attr in attrs:
                setattr(stub, attr, None)
            sys.modules[name] = stub
    # Its OpenAI backend reads the endpoint from the environment (openai's OPENAI_BASE_URL).
    os.environ["OPENAI_BASE_URL"] = job["base_url"]
    os.environ["OPENAI_API_KEY"] = "local"
    import numpy as np
    from chromadb.api.types import EmbeddingFunction
    from openai import OpenAI
    import agentic_memory.retrievers as retrievers
    from agentic_memory.memory_system import AgenticMemorySystem

    client = OpenAI()

    class EndpointEmbedding(EmbeddingFunction):
        """The harness's embedder in place of A-Mem's sentence-transformers one (same MiniLM)."""

        def __init__(self, model_name=None):
            self.model = job["embed_model"]

        def __call__(self, input):
            texts = [input] if isinstance(input, str) else list(input)
            reply = client.embeddings.create(
                model=self.model, input=texts, encoding_format="float"
            )
            return [np.asarray(d.embedding, dtype=np.float32) for d in reply.data]

        @staticmethod
        def name():
            return "lycheemem-endpoint"

        def get_config(self):
            return {"model": self.model}

        def default_space(self):
            # What A-Mem's own sentence-transformers embedding function asks Chroma for.
            return "cosine"

        @staticmethod
        def build_from_config(config):
            return EndpointEmbedding()

    retrievers.SentenceTransformerEmbeddingFunction = EndpointEmbedding
    system = AgenticMemorySystem(
        model_name=job["embed_model"],
        llm_backend="openai",
        llm_model=job["llm_model"],
        storage_path=os.path.join(job["store_dir"], "chroma"),
    )
    # A-Mem's own sampling settings stay (temperature 1.0, its OpenAI backend's default):
    # decoding greedily, Qwen2.5-Coder-0.5B repeated itself inside every evolution reply (a trial)
    # until the token cap.
    # A-Mem keeps a note whose analysis or evolution call failed, with defaults; count them.
    logging.getLogger("agentic_memory.memory_system").addHandler(AMEM_ERRORS)
    analyze = system.analyze_content

    def counted_analysis(content):
        result = analyze(content)
        if result == AMEM_NO_ANALYSIS:
            AMEM_ERRORS.count += 1
        return result

    system.analyze_content = counted_analysis
    return system


def amem_add(memory, job, key, session, group, first_speaker):
    turn = group[0]
    if memory.retriever.collection.get(ids=[key])["ids"]:
        return  # added before a crash that came ahead of the progress file
    who = turn.get("speaker") or turn["role"]
    errors = AMEM_ERRORS.count
    # The authors' LoCoMo evaluation writes each turn as "Speaker <name>says : <text>".
    memory.add_note(
        f"Speaker {who} says : {turn['text']}",
        time=amem_time(session.get("date")),
        id=key,
    )
    return AMEM_ERRORS.count > errors


def amem_search(memory, job, question):
    hits = []
    sessions = {s["id"]: s for s in job["sessions"]}
    found_all = memory.search_agentic(question, k=job["top_k"])
    if not found_all and memory.retriever.count() > 0:
        # search_agentic logs an error and returns nothing when its search fails.
        raise RuntimeError(f"A-Mem's search failed for {question!r} (its log above says why)")
    last_score = 0.0
    for found in found_all:
        note = memory.read(found["id"])
        if note is None:
            raise RuntimeError(f"A-Mem's search returned {found['id']}, which it cannot read")
        session_id, _, turn = found["id"].rpartition("#")
        session = sessions.get(session_id, {})
        # What A-Mem's own evaluation hands its answerer for a note, less the time (the
        # harness prints each memory's session date itself).
        text = (
            f"{note.content}\tmemory context: {note.context}\t"
            f"memory keywords: {note.keywords}\tmemory tags: {note.tags}"
        )
        # Chroma returns a distance (the harness ranks by score, larger is better); a linked
        # note comes without one and ranks after the hit that brought it.
        distance = found.get("score")
        score = -float(distance) if distance is not None else last_score
        last_score = score
        hits.append(
            {
                "id": found["id"],
                "memory": text,
                "score": score,
                "session": session_id or None,
                "session_date": session.get("date"),
                "turns": [int(turn)] if turn.isdigit() else [],
            }
        )
    return hits


def amem_count(memory, job):
    return memory.retriever.count()


PEERS = {
    "mem0": (exchanges, open_mem0, mem0_add, mem0_search, mem0_count),
    "amem": (single_turns, open_amem, amem_add, amem_search, amem_count),
}


def post_harness(job, path, body):
    """Posts `body` to the harness's own route `path` on the endpoint. No read timeout, like the
    peers' model calls (`wait_for_the_endpoint`): the endpoint lives in the harness process,
    which can be paused or starved of CPU by the model work beside it (a 30 s timeout here once
    ended a finished mem0 build just before its searches); the harness bounds the build."""
    url = job["base_url"].rsplit("/v1", 1)[0] + path
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=None) as reply:
        reply.read()


def set_phase(job, phase):
    """Tells the harness's endpoint which phase the following calls belong to."""
    post_harness(job, "/lycheemem/phase", {"phase": phase})


def checkpoint(job, done, failed, seconds):
    """Has the endpoint write the progress file: the units now in the store, and with them the
    build's cost so far (its calls up to now, this run's `seconds`), so a kill loses neither."""
    progress = {"added": sorted(done), "failed": sorted(failed)}
    post_harness(job, "/lycheemem/checkpoint", {"progress": progress, "seconds": seconds})


def wait_for_the_endpoint():
    """Makes every OpenAI client the peers create wait for the harness's endpoint as long as it
    takes. The client's own default (a 600 s read timeout, then two retries) suits a hosted API;
    here the endpoint is a local model on a busy CPU, where a long prompt queued behind other
    requests can take longer than that. A timed-out request is not cancelled on the server: it
    is computed anyway, the retry asks for it again, and after the last retry the peer gives up
    on the unit. The harness bounds the build's time itself (it stops or kills the driver)."""
    import openai

    init = openai.OpenAI.__init__

    def init_without_timeout(self, *args, **kwargs):
        kwargs.setdefault("timeout", None)
        init(self, *args, **kwargs)

    openai.OpenAI.__init__ = init_without_timeout


def exit_with_the_harness():
    """Ends the driver when the harness that started it is gone. The harness holds the write
    end of the driver's stdin, a pipe, for as long as it waits for the driver; any end of the
    harness, a kill included, closes it, and this thread, reading that pipe, sees its end. (A
    driver left running would go on with the endpoint gone: its peer keeps units whose calls
    failed, with defaults, and reports them added.) Only when the harness asks for it
    (`LYCHEEMEM_DRIVER_WATCH=1`) and stdin is a pipe: a driver run by hand watches nothing."""
    import stat
    import threading

    if os.environ.get("LYCHEEMEM_DRIVER_WATCH") != "1":
        return
    try:
        if not stat.S_ISFIFO(os.fstat(0).st_mode):
            return
    except OSError:
        return

    def watch():
        # The file descriptor, not `sys.stdin`: a thread blocked in a buffered reader holds its
        # lock, which the interpreter's shutdown then cannot take (a fatal error at exit).
        while os.read(0, 4096):
            pass
        print("the harness is gone: the driver stops", file=sys.stderr, flush=True)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    exit_with_the_harness()
    wait_for_the_endpoint()
    if job["peer"] not in PEERS:
        sys.exit(f"unknown peer {job['peer']!r} (known: {', '.join(PEERS)})")
    units_of, open_peer, add, search, count = PEERS[job["peer"]]
    os.makedirs(job["store_dir"], exist_ok=True)
    progress_file = os.path.join(job["store_dir"], "progress.json")
    done, failed = set(), set()
    if os.path.exists(progress_file):
        with open(progress_file, encoding="utf-8") as f:
            saved = json.load(f)
        done, failed = set(saved["added"]), set(saved.get("failed", []))
    memory = open_peer(job)
    first_speaker = next(
        (t.get("speaker") for s in job["sessions"] for t in s["turns"] if t.get("speaker")),
        None,
    )
    units = list(units_of(job["sessions"]))
    beyond = done - {key for key, _, _ in units}
    if beyond:
        sys.exit(
            f"{job['store_dir']} holds {len(beyond)} units outside this run's sessions "
            f"(e.g. {sorted(beyond)[0]}); a slice needs its own cache folder"
        )
    started = time.time()
    for n, (key, session, group) in enumerate(units, 1):
        if key in done:
            continue
        if add(memory, job, key, session, group, first_speaker):
            failed.add(key)
        done.add(key)
        checkpoint(job, done, failed, time.time() - started)
        print(
            f"{job['peer']} {job['user_id']}: unit {n}/{len(units)} added "
            f"({time.time() - started:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    set_phase(job, "search")
    with open(job["hits_out"], "w", encoding="utf-8") as out:
        for q in job["questions"]:
            t0 = time.time()
            hits = search(memory, job, q["question"])
            line = {"question_id": q["id"], "hits": hits, "ms": (time.time() - t0) * 1e3}
            out.write(json.dumps(line) + "\n")
    print(
        json.dumps(
            {
                "units": len(units),
                "failed_units": len(failed),
                "memories": count(memory, job),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
