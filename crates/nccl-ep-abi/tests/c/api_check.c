/* Checks epflow's libnccl_ep.so through its generated header, with no GPU needed: the version,
 * the size and magic checks, ncclInvalidArgument on bad arguments, tensor descriptors, and a
 * clean error (no crash) from calls that need a GPU. Exit status 0 = every check passed. */
#include <stdio.h>
#include <string.h>

#include "nccl_ep.h"

#include "check.h"

int main(int argc, char** argv) {
    int no_gpu = argc > 1 && strcmp(argv[1], "--no-gpu") == 0;
    int version = -1;
    CHECK(ncclEpGetVersion(&version) == ncclSuccess);
    CHECK(version == NCCL_EP_VERSION_CODE && version == 100);
    CHECK(ncclEpGetVersion(NULL) == ncclInvalidArgument);
    CHECK(epflowNcclEpAbiVersion == 100);

    /* Tensor descriptors: the library owns the descriptor and its sizes, never the data. */
    size_t dims[2] = {4, 7168};
    ncclEpTensor_t* t = NULL;
    CHECK(ncclEpTensorAlloc(&t, 2, ncclBfloat16, dims, NULL) == ncclSuccess);
    CHECK(t != NULL && t->ndim == 2 && t->data == NULL && t->sizes[1] == 7168);
    ncclEpTensorAllocConfig_t tcfg = NCCL_EP_TENSOR_ALLOC_CONFIG_INIT;
    ncclEpTensor_t* t2 = NULL;
    CHECK(ncclEpTensorAlloc(&t2, 1, ncclInt32, dims, &tcfg) == ncclSuccess);
    tcfg.magic = 0;
    CHECK(ncclEpTensorAlloc(&t2, 1, ncclInt32, dims, &tcfg) == ncclInvalidArgument);
    CHECK(ncclEpTensorAlloc(NULL, 2, ncclBfloat16, dims, NULL) == ncclInvalidArgument);
    CHECK(ncclEpTensorAlloc(&t2, 0, ncclBfloat16, dims, NULL) == ncclInvalidArgument);
    CHECK(ncclEpTensorAlloc(&t2, 2, ncclBfloat16, NULL, NULL) == ncclInvalidArgument);
    ncclEpTensor_t on_stack = NCCL_EP_TENSOR_INIT;
    CHECK(ncclEpTensorDestroy(&on_stack) == ncclInvalidArgument);
    CHECK(ncclEpTensorDestroy(NULL) == ncclSuccess);
    CHECK(ncclEpTensorDestroy(t) == ncclSuccess);

    /* Struct size and magic checks (the communicator is never reached: they fail first). */
    ncclComm_t not_a_comm = (ncclComm_t)(void*)&failures;
    ncclEpGroup_t group = NULL;
    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    CHECK(cfg.size == sizeof(ncclEpGroupConfig_t) && cfg.magic == NCCL_EP_MAGIC && cfg.version == 1);
    cfg.num_experts = 16;
    cfg.max_dispatch_tokens_per_rank = 128;
    cfg.max_token_bytes = 7168 * 2;
    ncclEpGroupConfig_t bad = cfg;
    bad.size = 8;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    bad = cfg;
    bad.magic = 0;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    CHECK(ncclEpCreateGroup(&group, not_a_comm, NULL) == ncclInvalidArgument);
    CHECK(ncclEpCreateGroup(NULL, not_a_comm, &cfg) == ncclInvalidArgument);
    CHECK(ncclEpCreateGroup(&group, NULL, &cfg) == ncclInvalidArgument);
    bad = cfg;
    bad.algorithm = (ncclEpAlgorithm_t)7;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    /* A config.version this library does not implement is refused before anything else. */
    bad = cfg;
    bad.version = 99;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    bad.version = 0;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);

    /* Null groups and handles. */
    CHECK(ncclEpGroupDestroy(NULL) == ncclInvalidArgument);
    CHECK(ncclEpHandleDestroy(NULL) == ncclInvalidArgument);
    ncclEpDispatchInputs_t in = NCCL_EP_DISPATCH_INPUTS_INIT;
    ncclEpDispatchOutputs_t out = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    CHECK(ncclEpDispatch(NULL, &in, &out, NULL, NULL, NULL) == ncclInvalidArgument);
    ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
    ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
    CHECK(ncclEpCombine(NULL, &cin, &cout, NULL, NULL) == ncclInvalidArgument);
    CHECK(ncclEpComplete(NULL, NULL, NULL) == ncclInvalidArgument);
    int err = 0;
    CHECK(ncclEpGetAsyncError(NULL, &err) == ncclInvalidArgument);
    CHECK(ncclEpErrorClear(NULL) == ncclInvalidArgument);
    CHECK(ncclEpMaskClean(NULL, NULL) == ncclInvalidArgument);

    /* Values that name no live handle or group (destroyed already, or never made by this
     * library): refused with ncclInvalidArgument, never dereferenced, however often. */
    ncclEpHandle_t stale = (ncclEpHandle_t)(void*)&failures;
    CHECK(ncclEpHandleDestroy(stale) == ncclInvalidArgument);
    CHECK(ncclEpHandleDestroy(stale) == ncclInvalidArgument);
    CHECK(ncclEpDispatch(stale, &in, &out, NULL, NULL, NULL) == ncclInvalidArgument);
    CHECK(ncclEpCombine(stale, &cin, &cout, NULL, NULL) == ncclInvalidArgument);
    CHECK(ncclEpComplete(stale, NULL, NULL) == ncclInvalidArgument);
    CHECK(ncclEpUpdateHandle(stale, NULL, NULL, NULL) == ncclInvalidArgument);
    ncclEpGroup_t stale_group = (ncclEpGroup_t)(void*)&version;
    CHECK(ncclEpGroupDestroy(stale_group) == ncclInvalidArgument);
    CHECK(ncclEpGroupDestroy(stale_group) == ncclInvalidArgument);
    CHECK(ncclEpGetAsyncError(stale_group, &err) == ncclInvalidArgument);
    CHECK(ncclEpErrorClear(stale_group) == ncclInvalidArgument);
    ncclEpHandle_t h = NULL;
    CHECK(ncclEpInitHandle(&h, stale_group, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, 8, NULL) == ncclInvalidArgument);
    CHECK(h == NULL);
    CHECK(ncclEpCreateHandle(&h, stale_group, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, NULL, NULL, NULL) ==
          ncclInvalidArgument);
    size_t mem = 0;
    CHECK(ncclEpHandleMemSize(stale_group, NCCL_EP_LAYOUT_EXPERT_MAJOR, NULL, &mem, 8) == ncclInvalidArgument);

    /* API v2's 112-byte group config (NVIDIA/nccl-extensions): read up to its size (zero_copy
     * ON is read and logged); a size of no known layout is refused. */
    struct {
        ncclEpGroupConfig_t v1;
        int zero_copy, overflow_policy;
        unsigned int num_topk;
        unsigned char padding_v2[4];
    } v2;
    memset(&v2, 0, sizeof v2);
    v2.v1 = cfg;
    v2.v1.size = 112;
    v2.v1.version = 2;
    CHECK(sizeof v2 == 112);
    v2.zero_copy = 2; /* NCCL_EP_ZERO_COPY_ON: accepted (logged), then no GPU */
    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &v2.v1) == ncclInvalidUsage);
    }
    v2.zero_copy = 0;
    v2.v1.size = 100;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &v2.v1) == ncclInvalidArgument);
    v2.v1.size = 112;
    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &v2.v1) == ncclInvalidUsage);
    }

    /* A well-formed group config on a machine without a GPU (the harness says so): a clean
     * error, not a crash. */
    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &cfg) == ncclInvalidUsage);
    }

    if (failures == 0) printf("api_check: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
