"""How much a chain's next draft is worth, learnt from its verifications: the priced
confidence gate (runner/draft_gate.py).

After a chain's j-th draft, the product c_j of its drafts' probabilities says how
likely drafts 1 .. j are all accepted, and the (j + 1)-th draft gains a token only if
they are and it is too. What that gain is at a given c_j is the head's own matter, so
it is learnt: per depth j and per band of c_j, the share of verified (j + 1)-th drafts
accepted with all before them. Measured on eagle's trained head (24 held-out prompts,
every chain drawn to K = 4): after the first draft, c_1 around 0.55 / 0.65 / 0.75 /
0.85 gained 0.16 / 0.33 / 0.40 / 0.52 from the second draft, well under c_1 itself.

The scheduler says what a draft must gain this step (`SchedulerOutput.draft_price`,
from the goodput policy's step-time model): a chain goes on past draft j where its
next draft is learnt to gain the price of its rows, and the chains going on together
gain the price of the drafter pass they run on (`ChainsGoingOn`). A machine where a
drafter pass and a verified row cost more of a step stops more chains, with no
threshold to tune.

Only chains that went on teach the band they went on from, so a band starts at a
prior, the band's middle squared (the next draft as sure as the chain so far). It
errs high after the first draft, so such bands are tried until their record says
otherwise, and a little low after the second (measured after the first draft at
0.55 / 0.65 / 0.75 / 0.85: 0.16 / 0.33 / 0.40 / 0.52 against the prior's 0.30 / 0.42
/ 0.56 / 0.72; after the second, at 0.54 / 0.63 / 0.74: 0.35 / 0.53 / 0.67 against
0.29 / 0.40 / 0.55). Records fade per step (`decay`), so a band written off is tried again
later, and the gate follows a workload that changes. (A prior of c_j itself, the
next draft sure to be accepted, tried bands that lose for longer: under the goodput
policy it ran between the thresholds 0.25 and 0.7, README.)
"""

from __future__ import annotations

import numpy as np

from spec_decode.price import DraftPrice

NUM_BANDS = 10  # of c_j in [0, 1], equal widths
# Depths learnt apart (j = 1, 2, then every deeper one together): the first draft's
# c_1 is read from one pass, deeper ones multiply more, and chains past the third
# draft are too few to learn alone.
NUM_DEPTHS = 3


class DraftCalibration:
    """Per depth and band of the chain's confidence product, the decayed count of next
    drafts verified and accepted; each request's last chain until it is verified."""

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.999) -> None:
        self.prior_weight = prior_weight
        self.decay = decay
        self.edges = np.linspace(0.0, 1.0, NUM_BANDS + 1)
        # The band's middle squared: the next draft as sure as the chain so far.
        self.prior = ((self.edges[:-1] + self.edges[1:]) / 2) ** 2
        self.seen = np.zeros((NUM_DEPTHS, NUM_BANDS))
        self.won = np.zeros((NUM_DEPTHS, NUM_BANDS))
        self._chains: dict[str, list[float]] = {}  # request -> c_1, c_2, ... proposed

    def gains(self) -> np.ndarray:
        """[NUM_DEPTHS, NUM_BANDS] the expected gain of the next draft."""
        w = self.prior_weight
        return (self.won + w * self.prior) / (self.seen + w)

    def envelope(self) -> np.ndarray:
        """[NUM_DEPTHS, NUM_BANDS] `gains`, each band's the least of its own and every
        band's above it: a chain goes on only where no surer chain is learnt to lose
        (the record of a band is noisy; a hole in the middle is taken for noise)."""
        return np.minimum.accumulate(self.gains()[:, ::-1], axis=1)[:, ::-1]

    def going_on(self, price: DraftPrice) -> ChainsGoingOn:
        """This step's choice of which chains go on (`ChainsGoingOn`), at `price`."""
        return ChainsGoingOn(self.envelope(), price)

    def remember(self, req_id: str, products: list[float]) -> None:
        """The confidence products after each draft `req_id` proposed this step."""
        if len(products) > 1:
            self._chains[req_id] = products
        else:  # one draft teaches nothing of the next
            self._chains.pop(req_id, None)

    def learn(self, req_ids: list[str], num_spec: np.ndarray, accepted: np.ndarray,
              samples: np.ndarray) -> None:
        """A step's verifications: each sampling request's chain remembered last step,
        its first `num_spec` drafts verified and `accepted` of them accepted."""
        self.seen *= self.decay
        self.won *= self.decay
        if not self._chains:
            return
        for i in np.flatnonzero(samples).tolist():
            chain = self._chains.pop(req_ids[i], None)
            if chain is not None:
                self._count(chain[:int(num_spec[i])], int(accepted[i]))

    def _count(self, verified: list[float], accepted: int) -> None:
        """One chain's verified drafts (their products c_1, c_2, ...), `accepted` of
        them accepted: after draft j, the next was won where j + 1 were accepted."""
        if len(verified) < 2:
            return
        after = np.arange(1, len(verified))  # j
        depth = np.minimum(after, NUM_DEPTHS) - 1
        band = np.minimum((np.array(verified[:-1]) * NUM_BANDS).astype(np.int64),
                          NUM_BANDS - 1)
        np.add.at(self.seen, (depth, band), 1.0)
        np.add.at(self.won, (depth, band), (after + 1 <= accepted).astype(float))

    def forget(self, req_id: str) -> None:
        """`req_id` left, or its drafts will not be verified (preempted)."""
        self._chains.pop(req_id, None)


class ChainsGoingOn:
    """Which chains draft once more at one step's price: those whose next draft is
    learnt to gain at least its rows' price, and only if together they gain the
    price of the drafter pass they run on past those rows (one pass serves every
    chain that goes on; at one request a chain goes on where its next draft pays
    both)."""

    def __init__(self, envelope: np.ndarray, price: DraftPrice) -> None:
        self.envelope = envelope
        self.price = price

    def __call__(self, products: np.ndarray, depth: int) -> np.ndarray:
        """[R] whether each chain with `depth` drafts so far, of confidence product
        `products` [R], drafts again."""
        band = np.minimum((products * NUM_BANDS).astype(np.int64), NUM_BANDS - 1)
        surplus = self.envelope[min(depth, NUM_DEPTHS) - 1, band] - self.price.per_row
        keep = surplus >= 0.0
        if float(surplus[keep].sum()) < self.price.per_pass:
            keep[:] = False
        return keep
