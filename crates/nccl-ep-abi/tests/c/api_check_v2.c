/* Checks epflow's libnccl_ep.so through its API v2 header, with no GPU needed: the v2 layouts
 * and constants, NCCL_EP_GROUP_CONFIG_INIT writing version 2, the v2 fields read up to the
 * caller's size, the v2 features epflow does not implement refused (ncclInvalidUsage), bad
 * values and versions refused (ncclInvalidArgument). Built twice by tests/c_api.rs: including
 * nccl_ep_v2.h (-DEPFLOW_INCLUDE_V2_HEADER) and including nccl_ep.h after
 * -DNCCL_EP_API_VERSION=2. Exit status 0 = every check passed. */
#include <stdio.h>
#include <string.h>

#ifdef EPFLOW_INCLUDE_V2_HEADER
#include "nccl_ep_v2.h"
#else
#include "nccl_ep.h"
#endif

#if NCCL_EP_API_VERSION != 2
#error "expected API version 2"
#endif

#include "check.h"

int main(int argc, char** argv) {
    int no_gpu = argc > 1 && strcmp(argv[1], "--no-gpu") == 0;
    int version = -1;
    CHECK(ncclEpGetVersion(&version) == ncclSuccess && version == NCCL_EP_VERSION_CODE);

    /* The v2 layouts and constants. */
    CHECK(sizeof(ncclEpGroupConfig_t) == 112 && NCCL_EP_GROUP_CONFIG_SIZE == 112);
    CHECK(NCCL_EP_GROUP_CONFIG_V1_SIZE == 96 && NCCL_EP_GROUP_CONFIG_V2_SIZE == 112);
    CHECK(sizeof(ncclEpLayoutInfo_t) == 48 && sizeof(ncclEpCombineInputs_t) == 32);
    CHECK(sizeof(ncclEpDispatchConfig_t) == 24 && sizeof(ncclEpCombineConfig_t) == 20);
    CHECK(NCCL_EP_OVERFLOW_DROP == 2 && NCCL_EP_EXPERT_ID_GLOBAL == 2 && NCCL_EP_DISP_QUANT_DS_FP8E3M4 == 2);
    CHECK(NCCL_EP_COMB_QUANT_NVFP4 == 1 && (int)ncclFloat4x2 == 12);

    ncclEpGroupConfig_t cfg = NCCL_EP_GROUP_CONFIG_INIT;
    CHECK(cfg.size == 112 && cfg.magic == NCCL_EP_MAGIC && cfg.version == 2);
    CHECK(cfg.zero_copy == NCCL_EP_ZERO_COPY_AUTO && cfg.overflow_policy == NCCL_EP_OVERFLOW_AUTO);
    CHECK(cfg.num_topk == 0);
    CHECK(NCCL_EP_HAS_FIELD(&cfg, ncclEpGroupConfig_t, num_topk));
    cfg.num_experts = 16;
    cfg.max_dispatch_tokens_per_rank = 128;
    cfg.max_token_bytes = 7168 * 2;

    ncclComm_t not_a_comm = (ncclComm_t)(void*)&failures;
    ncclEpGroup_t group = NULL;
    ncclEpGroupConfig_t bad = cfg;
    /* A version this library does not implement. */
    bad.version = 3;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    bad.version = 0;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    /* zero_copy ON: read and logged (window tensors are resolved in place), then no GPU. */
    bad = cfg;
    bad.zero_copy = NCCL_EP_ZERO_COPY_ON;
    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidUsage);
    }
    /* Values that are no enumerator, a top-k out of range, a size of no known layout. */
    bad = cfg;
    bad.zero_copy = (ncclEpZeroCopyMode_t)7;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    bad = cfg;
    bad.overflow_policy = (ncclEpOverflowPolicy_t)5;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    /* NCCL_EP_OVERFLOW_DROP is accepted: without a GPU the group stops only there. */
    if (no_gpu) {
        bad = cfg;
        bad.overflow_policy = NCCL_EP_OVERFLOW_DROP;
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidUsage);
    }
    bad = cfg;
    bad.num_topk = 1000;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    bad = cfg;
    bad.size = 100;
    CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidArgument);
    CHECK(group == NULL);

    /* A caller that says it has only the v1 fields: the v2 fields beyond its size are not read
     * (the invalid zero_copy would be ncclInvalidArgument), so on a machine without a GPU the
     * config passes every check and creating the group is ncclInvalidUsage (no GPU). */
    bad = cfg;
    bad.size = NCCL_EP_GROUP_CONFIG_V1_SIZE;
    bad.zero_copy = (ncclEpZeroCopyMode_t)7;
    CHECK(!NCCL_EP_HAS_FIELD(&bad, ncclEpGroupConfig_t, zero_copy));
    if (no_gpu) {
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &bad) == ncclInvalidUsage);
        CHECK(ncclEpCreateGroup(&group, not_a_comm, &cfg) == ncclInvalidUsage);
    }

    /* The other v2 structs, passed with a handle that is no live handle: the handle is refused
     * first (nothing dereferenced). */
    ncclEpHandle_t stale = (ncclEpHandle_t)(void*)&failures;
    ncclEpDispatchInputs_t in = NCCL_EP_DISPATCH_INPUTS_INIT;
    ncclEpDispatchOutputs_t out = NCCL_EP_DISPATCH_OUTPUTS_INIT;
    ncclEpLayoutInfo_t info = NCCL_EP_LAYOUT_INFO_INIT;
    ncclEpDispatchConfig_t dcfg = NCCL_EP_DISPATCH_CONFIG_INIT;
    CHECK(info.size == 48 && info.recv_topk_idx_kind == NCCL_EP_EXPERT_ID_AUTO);
    CHECK(dcfg.size == 24 && dcfg.quant_recipe == NCCL_EP_DISP_QUANT_NONE);
    dcfg.quant_recipe = NCCL_EP_DISP_QUANT_DS_FP8E3M4;
    CHECK(ncclEpDispatch(stale, &in, &out, &info, &dcfg, NULL) == ncclInvalidArgument);
    ncclEpCombineInputs_t cin = NCCL_EP_COMBINE_INPUTS_INIT;
    ncclEpCombineOutputs_t cout = NCCL_EP_COMBINE_OUTPUTS_INIT;
    ncclEpCombineConfig_t ccfg = NCCL_EP_COMBINE_CONFIG_INIT;
    CHECK(cin.size == 32 && cin.scales == NULL && ccfg.size == 20);
    ccfg.quant_recipe = NCCL_EP_COMB_QUANT_NVFP4;
    CHECK(ncclEpCombine(stale, &cin, &cout, &ccfg, NULL) == ncclInvalidArgument);

    if (failures == 0) printf("api_check_v2: all checks passed\n");
    return failures == 0 ? 0 : 1;
}
