"""The weight wire format both ends of a weight update speak: tensor specs, the update header and
its chunks, digests, and the collective rendezvous. The policy server and the learner import it;
it imports neither."""
