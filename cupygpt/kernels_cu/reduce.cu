// Column sums (bias and layernorm weight gradients): out (OC) += sum over N rows of in (N,OC);
// and the gradient norm's sum of squares. Two deterministic stages each instead of atomics,
// so a step's gradients (and its clipping) are reproducible.
#include "common.cuh"

// Stage 1. Launch: grid (ceil(OC/COL_TILE), R), block (COL_TILE, ROW_LANES): a lane per
// column, so each row is read coalesced; chunk r sums rows
// [r*rows_per_chunk, (r+1)*rows_per_chunk) into partial[r, c].
extern "C" __global__ void column_sum_partial(float* partial, const float* in, int N, int OC,
                                              int rows_per_chunk) {
    __shared__ float acc[ROW_LANES][COL_TILE];
    int c = blockIdx.x * COL_TILE + threadIdx.x;
    int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float s = 0.f;
    if (c < OC)
        for (int r = r0 + threadIdx.y; r < r1; r += ROW_LANES) s += in[(long long)r * OC + c];
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < OC) {
        float t = 0.f;
        for (int k = 0; k < ROW_LANES; k++) t += acc[k][threadIdx.x];
        partial[(long long)blockIdx.y * OC + c] = t;
    }
}

// Stage 2. Launch: EW_THREADS per block over OC columns; sums the R partials in order.
extern "C" __global__ void column_sum_finish(float* out, const float* partial, int R, int OC) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    float s = 0.f;
    for (int r = 0; r < R; r++) s += partial[(long long)r * OC + c];
    out[c] += s;
}

// The sum of squares, in double (so how the gradient is split over ranks changes no bit of
// the float norm): acc[0] += sum of x[i]^2. Stage 1. Launch: R blocks of EW_THREADS; block b
// sums its grid-strided share into partial[b].
extern "C" __global__ void sum_squares_partial(double* partial, const float* x, long long n) {
    __shared__ double part[EW_THREADS / WARP];
    double s = 0.0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        double v = x[i];
        s += v * v;
    }
    s = warp_sum_d(s);
    if (threadIdx.x % WARP == 0) part[threadIdx.x / WARP] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < EW_THREADS / WARP; k++) t += part[k];
        partial[blockIdx.x] = t;
    }
}

// Stage 2. Launch: one thread; adds the R partials in order.
extern "C" __global__ void sum_squares_finish(double* acc, const double* partial, int R) {
    double t = 0.0;
    for (int r = 0; r < R; r++) t += partial[r];
    acc[0] += t;
}
