/*
 * A plugin that depends on libibverbs, as UCX's, libfabric's and MPI's are: the program that
 * loads it with dlopen(RTLD_LOCAL) does not link libibverbs itself. Lists the devices, opens
 * each and makes a completion channel (two of the calls xroce's provider interposes), and
 * prints one line per device: "device NAME channel ok|FAILED".
 */
#include <stdio.h>
#include <infiniband/verbs.h>

int plugin_run(void)
{
    int n = -1;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list) {
        perror("ibv_get_device_list");
        return 0;
    }
    int channels = 0;
    for (int i = 0; i < n; i++) {
        struct ibv_context *ctx = ibv_open_device(list[i]);
        struct ibv_comp_channel *ch = ctx ? ibv_create_comp_channel(ctx) : NULL;
        printf("device %s channel %s\n", ibv_get_device_name(list[i]), ch ? "ok" : "FAILED");
        channels += ch != NULL;
        if (ch)
            ibv_destroy_comp_channel(ch);
        if (ctx)
            ibv_close_device(ctx);
    }
    ibv_free_device_list(list);
    return channels;
}
