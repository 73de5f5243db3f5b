"""The DAC codec of the Fish family (S1 and S2): network, batched streaming decoder, weights."""
