"""The plain claim reaps poison rows inside its own statement (one round trip), with
the same SQL as the stand-alone "reap" section the ordered claim runs. Until the claim
is composed from that section, this keeps the two texts identical: a change to one
that is not made to the other fails here. The differences allowed are the claim's
start bound on the processing index (where the claim cursor lets fast claims begin)
and its switch that lets most fast claims leave expired leases alone: with the bound
true and the switch true, the claim reaps exactly what "reap" does."""

from __future__ import annotations

import re

from outbox_relay.db.schema import EXECUTABLE


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def test_the_claim_holds_the_reap_statement_word_for_word():
    reap = _normalized(EXECUTABLE["reap"])
    claim = _normalized(
        re.sub(
            r"\s*AND \{leases_bound\}\s*AND \{lease_scan\}",
            "",
            EXECUTABLE["claim"],
            count=1,
        )
    )
    victims, update = re.fullmatch(r"WITH (victims AS \(.*?\)) (UPDATE .*)", reap).groups()
    assert claim.startswith(f"WITH {victims}, reaped AS ( {update} ),")
