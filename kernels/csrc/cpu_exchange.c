/* One MoE layer of the expert-parallel exchange over the sockets transport (kernels/comm/sockets.py,
 * engine/exchange/ep_exchange.py), each side in one call from Python. A worker's side
 * (raymoe_worker_layer):
 *
 *   1. each router's header message: rows, tag checksum, placement epoch, kind, then the
 *      assignments of each of the worker's S local slots (int64 each);
 *   2. each router's rows (when it has any): D float32 activations, k int32 local slots, k float32
 *      gate weights each;
 *   3. every router's rows through the experts at once (raymoe_run_rows, cpu_f32.c);
 *   4. to each router its rows' weighted sums, then the trailer (float64 expert seconds, int64
 *      combine tag checksum).
 * With FLAG_BF16 the rows carry D bfloat16 activations, the experts are cpu_bf16.c's
 * (raymoe_bf16_run_assignments; AMX's with FLAG_AMX) and each router gets each of its assignments'
 * outputs, unweighted, in (row, position) order (kernels/comm/wire.py::RowFormat.per_assignment).
 *
 * A router's side (raymoe_router_layer): its plan's headers and rows to every worker, then every
 * worker's sums and trailer into one buffer (the combine and the trailers' checks stay in Python).
 *
 * Every message is framed as sockets.py frames it: int64 message number (the k-th message
 * between two ranks carries k), int64 byte count, then the bytes; a number or size that
 * differs from what this rank expects means the ranks called collectives in different orders.
 * The header's fields and kinds, the frame, the row format, the flags, statuses and info fields
 * come from raymoe_constants.h, generated from kernels/comm/wire.py (kernels/native_library.py);
 * raymoe_constants reports them back, as this file sees them, for the loader to compare.
 * Why in C: at one decoding sequence a layer's worker side was ~180 us of Python around ~100 us
 * of experts, and the router's exchange ~100 us (benchmarks/bench_served_phases.py,
 * docs/BENCHMARKS.md).
 *
 * The sockets are non-blocking; every wait is a poll() on the socket and on `wake_fd` (readable
 * once the communicator is aborted) under one deadline for the layer. Errors return a negative
 * status with details in `info` (see raymoe_worker_layer); the caller breaks the communicator.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "raymoe_constants.h"

int64_t raymoe_run_rows(const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t D, int64_t I, int64_t k,
                        const int64_t *maps, const int64_t *seg_rows, int64_t segments, int64_t S,
                        const float *w13, const float *w2, int64_t P, int64_t expected, float *out);
/* cpu_bf16.c's, where the library was built with it (weak: NULL where the compiler could not build
 * that file; FLAG_BF16 is then refused, and the Python side never sets it: native_exchange.py). */
__attribute__((weak)) int64_t raymoe_bf16_run_assignments(
    const uint8_t *payload, int64_t N, int64_t row_bytes, int64_t D, int64_t I, int64_t k, const int64_t *maps,
    const int64_t *seg_rows, int64_t segments, int64_t S, const uint16_t *w13, const uint16_t *w2, int64_t P,
    int64_t expected, int64_t amx, uint16_t *out);

typedef int64_t frame_t[2]; /* a message's frame: its number, its byte count */
struct trailer {              /* after a worker's sums to a router */
    double seconds;           /* expert seconds */
    int64_t checksum;         /* the combine tag's checksum */
};

/* The constants this library was built with, as this file sees them (the frame's and the
 * trailer's sizes measured): `names`/`values` filled up to `capacity`; returns how many there are. */
int64_t raymoe_constants(const char **names, int64_t *values, int64_t capacity) {
#define RAYMOE_ENTRY(name) {#name, (int64_t)(name)},
    static const struct { const char *name; int64_t value; } table[] = {
        RAYMOE_CONSTANTS(RAYMOE_ENTRY)
        {"FRAME_BYTES", (int64_t)sizeof(frame_t)},
        {"TRAILER_BYTES", (int64_t)sizeof(struct trailer)},
    };
#undef RAYMOE_ENTRY
    const int64_t count = (int64_t)(sizeof table / sizeof table[0]);
    for (int64_t i = 0; i < count && i < capacity; i++) {
        names[i] = table[i].name;
        values[i] = table[i].value;
    }
    return count;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Until `fd` is ready for `events`: 0, or STATUS_TIMEOUT past the deadline, STATUS_ABORTED once wake_fd
 * is readable, STATUS_LOST when poll itself fails. A hang-up or error counts as ready: the read or
 * write that follows reports it. */
static int wait_ready(int fd, short events, int wake_fd, int64_t deadline_ns) {
    for (;;) {
        int64_t left = deadline_ns - now_ns();
        if (left <= 0) return STATUS_TIMEOUT;
        struct pollfd fds[2] = {{fd, events, 0}, {wake_fd, POLLIN, 0}};
        int64_t ms = (left + 999999) / 1000000;
        int ready = poll(fds, 2, ms > 1000 ? 1000 : (int)ms);
        if (ready < 0) {
            if (errno == EINTR) continue;
            return STATUS_LOST;
        }
        if (fds[1].revents) return STATUS_ABORTED;
        if (fds[0].revents) return 0;
    }
}

/* After a read or write that failed: 0 to try again (interrupted, or the socket is ready now),
 * else the status to return (the deadline, an abort, or a broken connection: errno in info[A]). */
static int after_failure(int fd, short events, int wake_fd, int64_t deadline_ns, int64_t *info) {
    if (errno == EINTR) return 0;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return wait_ready(fd, events, wake_fd, deadline_ns);
    info[INFO_A] = errno;
    return STATUS_LOST;
}

/* Drops the leading iovecs that `done` bytes filled, and trims the first one left. */
static void advance(struct iovec **iov, int *count, size_t done) {
    while (*count > 0 && done >= (*iov)->iov_len) {
        done -= (*iov)->iov_len;
        (*iov)++;
        (*count)--;
    }
    if (*count > 0 && done) {
        (*iov)->iov_base = (char *)(*iov)->iov_base + done;
        (*iov)->iov_len -= done;
    }
    while (*count > 0 && (*iov)->iov_len == 0) { (*iov)++; (*count)--; }
}

/* Reads one framed message of exactly `size` bytes into `body`, expecting message `number`.
 * The frame and the body are read together where they are there; the frame is checked as soon
 * as its 16 bytes are in, before the body counts (a frame that differs: STATUS_FRAME, the frame's
 * number and size in info[A], info[B]). */
static int read_message(int fd, int wake_fd, int64_t deadline_ns, int64_t number, uint8_t *body, int64_t size,
                        int64_t *info) {
    frame_t frame;
    struct iovec parts[2] = {{frame, sizeof frame}, {body, (size_t)size}};
    struct iovec *iov = parts;
    int count = size ? 2 : 1, checked = 0;
    size_t got_total = 0;
    while (count > 0) {
        ssize_t got = readv(fd, iov, count);
        if (got == 0) return STATUS_LOST;
        if (got < 0) {
            int status = after_failure(fd, POLLIN, wake_fd, deadline_ns, info);
            if (status) return status;
            continue;
        }
        got_total += (size_t)got;
        advance(&iov, &count, (size_t)got);
        if (!checked && got_total >= sizeof frame) {
            checked = 1;
            if (frame[0] != number || frame[1] != size) {
                info[INFO_A] = frame[0];
                info[INFO_B] = frame[1];
                return STATUS_FRAME;
            }
        }
    }
    return 0;
}

/* Writes every byte of iov[0..count) to `fd`. */
static int write_all(int fd, int wake_fd, int64_t deadline_ns, struct iovec *iov, int count, int64_t *info) {
    while (count > 0 && iov->iov_len == 0) { iov++; count--; }
    while (count > 0) {
        struct msghdr message;
        memset(&message, 0, sizeof message);
        message.msg_iov = iov;
        message.msg_iovlen = (size_t)count;
        ssize_t sent = sendmsg(fd, &message, MSG_NOSIGNAL);
        if (sent < 0) {
            int status = after_failure(fd, POLLOUT, wake_fd, deadline_ns, info);
            if (status) return status;
            continue;
        }
        advance(&iov, &count, (size_t)sent);
    }
    return 0;
}

/* One MoE layer of a worker, R routers at ranks 0..R-1 (fds[r] their sockets).
 *
 * recv_numbers[r], send_numbers[r]: the next message numbers from and to router r, advanced
 * here. headers [R][4 + S]: read here, or given (FLAG_HEADERS_GIVEN: read by an earlier call
 * with FLAG_HEADERS_ONLY, which returns STATUS_HEADERS_READ once they check out). FLAG_FIRST_LAYER: an
 * idle tick from every router is allowed (returns STATUS_IDLE). epochs [E] and maps [E][S]: the pool row
 * serving each local slot in each placement epoch this worker serves. w13/w2: the layer's
 * packed experts (P pool rows, hidden D, intermediate I, k positions a row); with FLAG_BF16 its
 * bfloat16 stacks as they lie ([P][2I][D], [P][D][I]).
 *
 * Returns STATUS_DONE with info[ROWS], info[ASSIGNMENTS], info[COMPUTE_NS]; STATUS_IDLE; STATUS_HEADERS_READ; or
 *   STATUS_TIMEOUT, STATUS_LOST (info[A]: errno or 0), STATUS_FRAME (info[A], info[B]: the frame got;
 *   info[C], info[D]: the number and size expected), STATUS_CHECKSUM (info[A]: the checksum got),
 *   STATUS_KINDS, STATUS_EPOCH (info[A]: the epoch), STATUS_ABORTED, STATUS_MEMORY, STATUS_ARGUMENTS, each with the
 *   router in info[PEER] where one is to blame (else -1) and info[SENDING] 1 when it happened
 *   sending the sums; or raymoe_run_rows's status (-1..-4). */
int64_t raymoe_worker_layer(
    const int32_t *fds, int64_t R, int32_t wake_fd, int64_t *recv_numbers, int64_t *send_numbers,
    int64_t *headers, int64_t S, int64_t flags, int64_t dispatch_checksum, int64_t combine_checksum,
    const int64_t *epochs, int64_t E, const int64_t *maps,
    const void *w13, const void *w2, int64_t P, int64_t D, int64_t I, int64_t k, int64_t timeout_ns,
    int64_t *info) {
    for (int i = 0; i < INFO_FIELDS; i++) info[i] = 0;
    info[INFO_PEER] = -1;
    if (R <= 0 || S <= 0 || D <= 0 || k <= 0 || E < 0) return STATUS_ARGUMENTS;
    const int64_t width = HEADER_FIELDS + S, deadline = now_ns() + timeout_ns;
    int status;
    if (!(flags & FLAG_HEADERS_GIVEN)) {
        for (int64_t r = 0; r < R; r++) {
            info[INFO_PEER] = r;
            info[INFO_C] = recv_numbers[r];
            info[INFO_D] = 8 * width;
            status = read_message(fds[r], wake_fd, deadline, recv_numbers[r], (uint8_t *)(headers + r * width),
                                  8 * width, info);
            if (status) return status;
            recv_numbers[r]++;
        }
        int idle = 0, step = 0, split = 0;
        for (int64_t r = 0; r < R; r++) {
            const int64_t *header = headers + r * width;
            if (header[HEADER_CHECKSUM] != dispatch_checksum) {
                info[INFO_PEER] = r;
                info[INFO_A] = header[HEADER_CHECKSUM];
                return STATUS_CHECKSUM;
            }
            idle += header[HEADER_KIND] == KIND_IDLE;
            step += header[HEADER_KIND] == KIND_STEP;
            split += header[HEADER_KIND] == KIND_SPLIT;
        }
        info[INFO_PEER] = -1;
        if (idle == R && (flags & FLAG_FIRST_LAYER)) return STATUS_IDLE;
        /* A step in two micro-batches says so in its first exchange only (every router alike). */
        if (step != R && !(split == R && (flags & FLAG_FIRST_LAYER))) return STATUS_KINDS;
        if (flags & FLAG_HEADERS_ONLY) return STATUS_HEADERS_READ;
    }
    const int bf16 = (flags & FLAG_BF16) != 0;
    if (!w13 || !w2 || !maps || P <= 0 || I <= 0 || (bf16 && !raymoe_bf16_run_assignments)) return STATUS_ARGUMENTS;
    /* Sizes, and each router's pool rows by its epoch. */
    const int64_t act = bf16 ? 2 : 4; /* bytes of an activation */
    const int64_t row_bytes = ROW_BYTES_OF(act, D, k);
    int64_t total = 0, segments = 0, expected = 0;
    int64_t *seg_rows = malloc(sizeof(int64_t) * (size_t)R);
    int64_t *seg_maps = malloc(sizeof(int64_t) * (size_t)(R * S));
    if (!seg_rows || !seg_maps) { free(seg_rows); free(seg_maps); return STATUS_MEMORY; }
    for (int64_t r = 0; r < R; r++) {
        const int64_t *header = headers + r * width;
        if (header[HEADER_ROWS] < 0) { free(seg_rows); free(seg_maps); info[INFO_PEER] = r; return STATUS_ARGUMENTS; }
        if (!header[HEADER_ROWS]) continue;
        int64_t e = 0;
        while (e < E && epochs[e] != header[HEADER_EPOCH]) e++;
        if (e == E) {
            free(seg_rows); free(seg_maps);
            info[INFO_PEER] = r;
            info[INFO_A] = header[HEADER_EPOCH];
            return STATUS_EPOCH;
        }
        memcpy(seg_maps + segments * S, maps + e * S, sizeof(int64_t) * (size_t)S);
        seg_rows[segments++] = header[HEADER_ROWS];
        total += header[HEADER_ROWS];
        for (int64_t s = 0; s < S; s++) expected += header[HEADER_FIELDS + s];
    }
    /* Rows in, router by router; out, one message a router: its rows' sums (or its assignments'
     * outputs), then the trailer. */
    const int64_t outputs = bf16 ? expected : total;
    uint8_t *payload = malloc((size_t)(total ? total : 1) * (size_t)row_bytes);
    uint8_t *sums = malloc((size_t)(act * (outputs ? outputs : 1) * D));
    if (!payload || !sums) { free(seg_rows); free(seg_maps); free(payload); free(sums); return STATUS_MEMORY; }
    int64_t offset = 0;
    status = 0;
    for (int64_t r = 0; r < R && !status; r++) {
        int64_t rows = headers[r * width + HEADER_ROWS];
        if (!rows) continue;
        info[INFO_PEER] = r;
        info[INFO_C] = recv_numbers[r];
        info[INFO_D] = rows * row_bytes;
        status = read_message(fds[r], wake_fd, deadline, recv_numbers[r], payload + offset * row_bytes,
                              rows * row_bytes, info);
        if (!status) recv_numbers[r]++;
        offset += rows;
    }
    int64_t assignments = 0, compute_ns = 0;
    if (!status && total) {
        info[INFO_PEER] = -1;
        int64_t started = now_ns();
        assignments = bf16 ? raymoe_bf16_run_assignments(payload, total, row_bytes, D, I, k, seg_maps, seg_rows,
                                                         segments, S, w13, w2, P, expected,
                                                         (flags & FLAG_AMX) != 0, (uint16_t *)sums)
                           : raymoe_run_rows(payload, total, row_bytes, D, I, k, seg_maps, seg_rows, segments, S,
                                             w13, w2, P, expected, (float *)sums);
        compute_ns = now_ns() - started;
        if (assignments < 0) status = (int)assignments;
    }
    offset = 0;
    info[INFO_SENDING] = 1;
    for (int64_t r = 0; r < R && !status; r++) {
        int64_t rows = headers[r * width + HEADER_ROWS]; /* its rows, or (FLAG_BF16) its assignments */
        if (bf16 && rows) {
            rows = 0;
            for (int64_t s = 0; s < S; s++) rows += headers[r * width + HEADER_FIELDS + s];
        }
        struct trailer trailer = {(double)compute_ns * 1e-9, combine_checksum};
        frame_t frame = {send_numbers[r], rows * act * D + (int64_t)sizeof trailer};
        struct iovec parts[3] = {{frame, sizeof frame}, {sums + offset * act * D, (size_t)(rows * act * D)},
                                 {&trailer, sizeof trailer}};
        info[INFO_PEER] = r;
        status = write_all(fds[r], wake_fd, deadline, parts, 3, info);
        if (!status) send_numbers[r]++;
        offset += rows;
    }
    free(seg_rows); free(seg_maps); free(payload); free(sums);
    if (status) return status;
    info[INFO_PEER] = -1;
    info[INFO_ROWS] = total;
    info[INFO_ASSIGNMENTS] = assignments;
    info[INFO_COMPUTE_NS] = compute_ns;
    return STATUS_DONE;
}

/* A router's side of one MoE layer: to each worker of the group (fds[i], worker index
 * workers[i], in rank order) its header (rows, tag checksum, epoch, `kind`, the
 * assignments of each of its S local slots) and its rows (packed: the plan's rows in worker
 * order, row_bytes each), then from each its rows' sums and trailer, into `received` (each
 * worker's rows * sum_bytes + TRAILER_BYTES, in rank order). send_counts [all workers] and
 * slot_counts [all workers][S] are the plan's. `parts`: PART_SEND, PART_RECEIVE or both; a
 * micro-batch schedule sends one exchange's part, works, then receives it (the same
 * arguments both times). Returns STATUS_DONE, or STATUS_TIMEOUT, STATUS_LOST, STATUS_FRAME,
 * STATUS_ABORTED, STATUS_MEMORY, STATUS_ARGUMENTS with info as raymoe_worker_layer's (info[PEER]: the index
 * into fds, info[SENDING] 1 when it happened sending). */
int64_t raymoe_router_layer(
    const int32_t *fds, const int64_t *workers, int64_t n, int32_t wake_fd, int64_t *recv_numbers,
    int64_t *send_numbers, const int64_t *send_counts, const int64_t *slot_counts, int64_t S, int64_t epoch,
    int64_t dispatch_checksum, int64_t kind, int64_t parts, const uint8_t *packed, int64_t row_bytes,
    uint8_t *received, int64_t sum_bytes, int64_t timeout_ns, int64_t *info) {
    for (int i = 0; i < INFO_FIELDS; i++) info[i] = 0;
    info[INFO_PEER] = -1;
    if (n <= 0 || S <= 0 || row_bytes <= 0 || sum_bytes <= 0 || parts < 1 || parts > 3) return STATUS_ARGUMENTS;
    const int64_t width = HEADER_FIELDS + S, deadline = now_ns() + timeout_ns;
    int64_t *header = malloc(sizeof(int64_t) * (size_t)width);
    if (!header) return STATUS_MEMORY;
    int64_t start = 0;
    int status = 0;
    info[INFO_SENDING] = 1;
    for (int64_t i = 0; i < n && !status && (parts & PART_SEND); i++) {
        const int64_t worker = workers[i], rows = send_counts[worker];
        if (rows < 0 || (rows && !packed)) { status = STATUS_ARGUMENTS; break; }
        header[HEADER_ROWS] = rows;
        header[HEADER_CHECKSUM] = dispatch_checksum;
        header[HEADER_EPOCH] = epoch;
        header[HEADER_KIND] = kind;
        memcpy(header + HEADER_FIELDS, slot_counts + worker * S, sizeof(int64_t) * (size_t)S);
        frame_t frames[2] = {{send_numbers[i], 8 * width}, {send_numbers[i] + 1, rows * row_bytes}};
        struct iovec parts[4] = {{frames[0], FRAME_BYTES}, {header, (size_t)(8 * width)}, {frames[1], FRAME_BYTES},
                                 {(void *)(packed + start * row_bytes), (size_t)(rows * row_bytes)}};
        info[INFO_PEER] = i;
        status = write_all(fds[i], wake_fd, deadline, parts, rows ? 4 : 2, info);
        if (!status) send_numbers[i] += rows ? 2 : 1;
        start += rows;
    }
    free(header);
    info[INFO_SENDING] = 0;
    int64_t offset = 0;
    for (int64_t i = 0; i < n && !status && (parts & PART_RECEIVE); i++) {
        const int64_t size = send_counts[workers[i]] * sum_bytes + TRAILER_BYTES;
        info[INFO_PEER] = i;
        info[INFO_C] = recv_numbers[i];
        info[INFO_D] = size;
        status = read_message(fds[i], wake_fd, deadline, recv_numbers[i], received + offset, size, info);
        if (!status) recv_numbers[i]++;
        offset += size;
    }
    if (status) return status;
    info[INFO_PEER] = -1;
    return STATUS_DONE;
}

/* A router's side of `layers` MoE layers in which it sends no rows (nothing this step, or the
 * layers a step did not reach): to each worker of the group (fds[i], in rank order) every
 * layer's header (0 rows, dispatch_checksums[l], epoch, KIND_STEP (the first: first_kind), S zero slot counts) in one
 * write, then from each worker every layer's trailer (TRAILER_BYTES, no sums), into `received`
 * ([layers][n][TRAILER_BYTES], layer-major). The messages are raymoe_router_layer's with no rows, in the
 * same order; only the waiting differs: a worker never waits for this router's round trip of
 * the layer before. Statuses and info as raymoe_router_layer's. */
int64_t raymoe_router_empty_layers(
    const int32_t *fds, int64_t n, int32_t wake_fd, int64_t *recv_numbers, int64_t *send_numbers,
    int64_t layers, const int64_t *dispatch_checksums, int64_t S, int64_t epoch, int64_t first_kind,
    uint8_t *received, int64_t timeout_ns, int64_t *info) {
    for (int i = 0; i < INFO_FIELDS; i++) info[i] = 0;
    info[INFO_PEER] = -1;
    if (n <= 0 || S <= 0 || layers <= 0) return STATUS_ARGUMENTS;
    const int64_t width = HEADER_FIELDS + S, framed = FRAME_BYTES / 8 + width, deadline = now_ns() + timeout_ns;
    int64_t *messages = calloc((size_t)(layers * framed), sizeof(int64_t));
    if (!messages) return STATUS_MEMORY;
    int status = 0;
    info[INFO_SENDING] = 1;
    for (int64_t i = 0; i < n && !status; i++) {
        for (int64_t l = 0; l < layers; l++) {
            int64_t *message = messages + l * framed;
            int64_t *header = message + FRAME_BYTES / 8;
            message[0] = send_numbers[i] + l;
            message[1] = 8 * width;
            header[HEADER_ROWS] = 0;
            header[HEADER_CHECKSUM] = dispatch_checksums[l];
            header[HEADER_EPOCH] = epoch;
            header[HEADER_KIND] = l ? KIND_STEP : first_kind;
        }
        struct iovec part = {messages, (size_t)(8 * layers * framed)};
        info[INFO_PEER] = i;
        status = write_all(fds[i], wake_fd, deadline, &part, 1, info);
        if (!status) send_numbers[i] += layers;
    }
    free(messages);
    info[INFO_SENDING] = 0;
    for (int64_t l = 0; l < layers && !status; l++) {
        for (int64_t i = 0; i < n && !status; i++) {
            info[INFO_PEER] = i;
            info[INFO_C] = recv_numbers[i];
            info[INFO_D] = TRAILER_BYTES;
            status = read_message(fds[i], wake_fd, deadline, recv_numbers[i], received + (l * n + i) * TRAILER_BYTES,
                                  TRAILER_BYTES, info);
            if (!status) recv_numbers[i]++;
        }
    }
    if (status) return status;
    info[INFO_PEER] = -1;
    return STATUS_DONE;
}

int64_t raymoe_plan_pack(const int64_t *ids, const float *weights, const uint8_t *kept, const int64_t *log2phy,
                         const int64_t *logcnt, int64_t T, int64_t k, int64_t E, int64_t R, int64_t S, int64_t W,
                         const float *hidden, int64_t D, int64_t *slot, int64_t *send_counts, int64_t *slot_counts,
                         int64_t *row_token, uint8_t *packed);

/* raymoe_router_moe_layer's int64 parameters, in this order */
enum { MOE_T, MOE_K, MOE_E, MOE_R, MOE_S, MOE_W, MOE_D, MOE_N, MOE_EPOCH, MOE_CHECKSUM, MOE_KIND, MOE_TIMEOUT_NS,
       MOE_WAKE_FD, MOE_COMBINE_CHECKSUM, MOE_PARAMS };

/* A router's whole MoE layer in one call, where its rows are float32 and a worker sends back one
 * weighted sum per dispatched row (the exchange's both parts, no micro-batches, no capacity
 * drops): raymoe_plan_pack's plan and packed rows (cpu_f32.c), raymoe_router_layer's messages to
 * and from the group's n workers (fds[i], worker index workers[i], rank order: worker order),
 * then the combine: each token's rows' sums added in float32 in the order they arrived, as
 * engine/experts.py::combine_partials adds them (a token's only row is copied; a token without
 * rows gets zeros). Each worker's trailer is checked here: its combine tag checksum must be
 * p[MOE_COMBINE_CHECKSUM] (else STATUS_CHECKSUM, info[PEER] the worker's index into fds, info[A]
 * the checksum got), and the slowest worker's expert seconds come back in expert_seconds[0].
 * p: int64 [MOE_PARAMS]: T, k, E, R, S, W, D, n, epoch, the dispatch tag's checksum, the first
 * header's kind, the deadline (ns), the abort wake fd and the combine tag's checksum.
 * Inputs: ids [T][k], weights [T][k] float32, log2phy [E][R], logcnt [E], hidden [T][D].
 * Outputs: counts [W + W*S] (send counts, then slot counts), rows[0] the rows sent (N), out [T][D],
 * expert_seconds[0]. Scratch: slot [T*k], row_token [T*W], packed [T*W][ROW_BYTES(D, k)],
 * received [T*n*D floats + n trailers]. Returns STATUS_DONE, STATUS_PLAN (nothing sent),
 * STATUS_CHECKSUM, or raymoe_router_layer's statuses with its info. */
int64_t raymoe_router_moe_layer(
    const int64_t *p, const int64_t *ids, const float *weights, const int64_t *log2phy, const int64_t *logcnt,
    const float *hidden, const int32_t *fds, const int64_t *workers, int64_t *recv_numbers, int64_t *send_numbers,
    int64_t *counts, int64_t *rows, float *out, double *expert_seconds, int64_t *slot, int64_t *row_token,
    uint8_t *packed, uint8_t *received, int64_t *info) {
    const int64_t T = p[MOE_T], k = p[MOE_K], S = p[MOE_S], W = p[MOE_W], D = p[MOE_D], n = p[MOE_N];
    for (int i = 0; i < INFO_FIELDS; i++) info[i] = 0;
    info[INFO_PEER] = -1;
    if (T < 0 || k <= 0 || D <= 0 || n <= 0 || W <= 0) return STATUS_ARGUMENTS;
    const int64_t N = raymoe_plan_pack(ids, weights, NULL, log2phy, logcnt, T, k, p[MOE_E], p[MOE_R], S, W, hidden,
                                       D, slot, counts, counts + W, row_token, packed);
    if (N == -2) return STATUS_MEMORY;
    if (N < 0) return STATUS_PLAN;
    rows[0] = N;
    const int64_t sum_bytes = 4 * D;
    /* the sums land at the front of `received`, the trailers after them (per worker: its sums,
     * then its trailer); a separate buffer keeps the sums contiguous for the combine */
    int64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += counts[workers[i]];
    uint8_t *staged = received;
    int64_t status = raymoe_router_layer(fds, workers, n, (int32_t)p[MOE_WAKE_FD], recv_numbers, send_numbers,
                                         counts, counts + W, S, p[MOE_EPOCH], p[MOE_CHECKSUM], p[MOE_KIND],
                                         PART_SEND | PART_RECEIVE, packed, ROW_BYTES(D, k), staged, sum_bytes,
                                         p[MOE_TIMEOUT_NS], info);
    if (status != STATUS_DONE) return status;
    /* each worker's trailer checked and taken out of the stream, its sums moved down to follow
     * the last worker's */
    int64_t at = 0, sums = 0;
    double slowest = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t size = counts[workers[i]] * sum_bytes;
        struct trailer trailer;
        memcpy(&trailer, staged + at + size, TRAILER_BYTES);
        if (trailer.checksum != p[MOE_COMBINE_CHECKSUM]) {
            info[INFO_PEER] = i;
            info[INFO_A] = trailer.checksum;
            return STATUS_CHECKSUM;
        }
        if (trailer.seconds > slowest) slowest = trailer.seconds;
        if (sums != at) memmove(staged + sums, staged + at, (size_t)size);
        at += size + TRAILER_BYTES;
        sums += size;
    }
    expert_seconds[0] = slowest;
    const float *partial = (const float *)staged;
    if (N == T && total == T) { /* one row a token, in token order (raymoe_plan_pack sends tokens ascending) */
        int64_t ordered = 1;
        for (int64_t j = 0; j < N && ordered; j++) ordered = row_token[j] == j;
        if (ordered) {
            memcpy(out, partial, sizeof(float) * (size_t)(T * D));
            return STATUS_DONE;
        }
    }
    uint8_t *seen = calloc((size_t)(T > 0 ? T : 1), 1);
    if (!seen) return STATUS_MEMORY;
    for (int64_t j = 0; j < total; j++) {
        const int64_t t = row_token[j];
        float *dst = out + t * D;
        const float *src = partial + j * D;
        if (!seen[t]) {
            memcpy(dst, src, sizeof(float) * (size_t)D);
            seen[t] = 1;
        } else {
            for (int64_t d = 0; d < D; d++) dst[d] += src[d];
        }
    }
    for (int64_t t = 0; t < T; t++)
        if (!seen[t]) memset(out + t * D, 0, sizeof(float) * (size_t)D);
    free(seen);
    return STATUS_DONE;
}
