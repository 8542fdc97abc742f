"""Flash attention's SASS-aware model: a block's walked tiles, each costing what its SASS
issues, blocks dispatched in the grid's order to the slots the occupancy leaves. Three
states of flash_attention.cu (d12: head size 64, bf16):
  measured  dfca9c6, the H200 profile's (h200-2026-11-26-profile.txt): 32-wide tiles
            loaded synchronously with qkv's bias added per tile, IEEE expf (per-element
            branches in backward), blocks head by head;
  head      this branch before cp.async (ee37b66): q, k, v read biased, exp2 with the mask
            on diagonal tiles only, every head's longest tile first; still synchronous;
  now       flash_attention.cu today: 64-wide tiles double-buffered through cp.async, the
            warp's own rows held as fragments (flash_sass.py reads these numbers).
Per tile and warp: instr issued on the common path, of which copy are the cp.async copies'
(or the synchronous loads'); rt the global round trips a tile waits for in turn (0 when the
tile was prefetched); expb the per-element exponential branches."""
import heapq

from .hw import CLK, HS, LAT_L2, NH, SMS, T

FLASH = {
    "measured": {"forward": dict(occ=5, cols=32, instr=395 + 340, copy=340, rt=8, expb=0, hmma=32),
                 "dq": dict(occ=4, cols=32, instr=451 + 340, copy=340, rt=8, expb=16, hmma=48),
                 "dkdv": dict(occ=3, cols=32, instr=510 + 290, copy=290, rt=7, expb=16, hmma=64)},
    "head": {"forward": dict(occ=6, cols=32, instr=405, copy=62, rt=4, expb=0, hmma=32),
             "dq": dict(occ=5, cols=32, instr=352, copy=58, rt=4, expb=0, hmma=48),
             "dkdv": dict(occ=3, cols=32, instr=486, copy=58, rt=5, expb=0, hmma=64)},
    # python -m dev.gpumodel.flash_sass, under TOOLS (tests/dev/test_gpumodel.py keeps
    # in step where the same versions are installed)
    "now": {"forward": dict(occ=4, cols=64, instr=626, copy=75, rt=0, expb=0, hmma=64, ldsm=32),
            "dq": dict(occ=3, cols=64, instr=481, copy=81, rt=0, expb=0, hmma=96, ldsm=48),
            "dkdv": dict(occ=3, cols=64, instr=650, copy=106, rt=0, expb=0, hmma=128, ldsm=64)},
}
# The NVRTC and cuobjdump FLASH["now"] was read with (flash_sass.tool_versions()): another
# version may count another SASS for the same source.
TOOLS = {"nvrtc": "13.5.37", "cuobjdump": "13.5.37"}
ORDER = {"measured": "heads", "head": "longest", "now": "longest"}
MATMULS = {"forward": 2, "dq": 3, "dkdv": 4}
FR = 64                # rows a block owns (16 * FLASH_WARPS)
CPI_DEP = 4.0          # cycles per instruction of one warp's dependent compute stream
EXP_CHAIN = 45         # cycles of one IEEE expf chain serialized by a per-element branch
BARRIER = 0.05e-6      # a tile's barrier and its skew
HMMA_CYC = 6           # SMSP cycles per HMMA.16816 (mma.sync at ~2/3 of sm_90's wgmma peak)
SMEM_BPC = 128         # shared memory bytes per cycle and SM (an LDSM.x4 moves 512)
WARPS = 4              # FLASH_WARPS


def makespan(occ, B=4, cols=32, order="longest"):
    """Tiles on the critical path: each (b, h) has T / FR blocks of (T / FR - y) * FR / cols
    tiles; dispatched in grid order to occ * 132 slots. heads: head by head (x the row
    tile, fastest); longest: every head's longest block before any shorter one."""
    nt = T // FR
    lens = [(nt - y) * FR // cols for _ in range(B * NH) for y in range(nt)]
    if order == "longest":
        lens.sort(reverse=True)
    slots = [0.0] * (occ * SMS)
    end = 0.0
    for n in lens:
        t = heapq.heappop(slots)
        heapq.heappush(slots, t + n)
        end = max(end, t + n)
    return end


def tile_time(k):
    """A tile's time for one block: with the tile prefetched (rt 0), the longest of its
    dependent compute stream, the SMSP's issue of occ warps' instructions, its tensor
    core's HMMA and the SM's shared memory (occ blocks' ldmatrix reads and cp.async
    writes of the walked tiles: two of cols rows of HS bf16; an L2 round trip at least);
    else its serialized round trips, then its compute."""
    comp = ((k["instr"] - k["copy"]) * CPI_DEP + k["expb"] * EXP_CHAIN) / CLK
    if k["rt"] == 0:
        pipes = k["occ"] * max(k["instr"], k["hmma"] * HMMA_CYC) / CLK
        smem = k["occ"] * (WARPS * k["ldsm"] * 512 + 2 * k["cols"] * HS * 2) / SMEM_BPC / CLK
        return max(comp, pipes, smem, LAT_L2) + BARRIER
    return k["rt"] * LAT_L2 + comp + BARRIER


def flash_time(kind, state="now", B=4, order=None):
    """Seconds per call of flash_{kind}_64 in a state of the kernels (uncalibrated)."""
    k = FLASH[state][kind]
    return makespan(k["occ"], B, k["cols"], order or ORDER[state]) * tile_time(k)


def flash_flops(kind, B=4):
    """FLOPs the kernel executes (causal half, its own matmuls: fwd 2, dq 3, dkdv 4)."""
    return MATMULS[kind] * 2.0 * B * NH * (T * T / 2) * HS
